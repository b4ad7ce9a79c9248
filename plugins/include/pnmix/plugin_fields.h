// pnmix/plugin_fields.h: the TensorRT plugin fields of the two pn-mix ops, without TensorRT.
//
// The ONNX exporter writes each op's attributes under pnmix/config.py's CONFIG_FIELDS names (plus
// plugin_version and plugin_namespace, which TensorRT's ONNX parser consumes itself). The parser
// hands the attributes to the plugin creator as a field collection: INT -> kINT32, FLOAT ->
// kFLOAT32, STRING -> kCHAR (NUL included in the length). An engine stores what the plugin's
// getFieldsToSerialize returns and gives it back to the creator when it is deserialized.
//
// This header is that parsing and serialization, checked field by field: a missing, duplicated,
// unknown, mistyped, wrongly sized or out-of-range field is an error with a one-line reason, and
// nothing is read beyond a field's declared length. It is plain C++ on purpose: the TensorRT
// plugins (plugins/trt/) and the CPU library libpnmix_fields (its C ABI below, which the Python
// tests call through ctypes) compile the very same code.
//
// pnmix_field mirrors nvinfer1::PluginField member for member; the type codes are
// nvinfer1::PluginFieldType's values (plugins/trt/ static_asserts both).
#ifndef PNMIX_PLUGIN_FIELDS_H
#define PNMIX_PLUGIN_FIELDS_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "format.h"
#include "params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* nvinfer1::PluginFieldType codes of the types pnmix fields use. */
#define PNMIX_FIELD_FLOAT32 1
#define PNMIX_FIELD_FLOAT64 2
#define PNMIX_FIELD_INT32 5
#define PNMIX_FIELD_CHAR 6
#define PNMIX_FIELD_INT64 10

/* One field: nvinfer1::PluginField's members, in its order. */
typedef struct pnmix_field {
  const char* name;
  const void* data;
  int32_t type;
  int32_t length; /* number of elements of `type` at data */
} pnmix_field;

/* Storage behind a serialized field collection: the fields point into this struct. */
typedef struct pnmix_field_storage {
  double high_ratio;
  int32_t ints[PNMIX_NUM_CONFIG_FIELDS];
  char pair_layout[16];
  pnmix_field fields[PNMIX_NUM_CONFIG_FIELDS];
} pnmix_field_storage;

#ifdef __cplusplus
}
#endif

namespace pnmix {

// The plugins' identity (generated.h, from export/ops.py): the exporter's nodes carry the same op
// types and attributes.
constexpr const char* kPluginVersion = PNMIX_PLUGIN_VERSION;
constexpr const char* kPluginNamespace = PNMIX_PLUGIN_NAMESPACE;
constexpr const char* kAttentionPluginName = PNMIX_ATTENTION_PLUGIN_NAME;
constexpr const char* kAppendPluginName = PNMIX_APPEND_PLUGIN_NAME;

// Longest field name or pair_layout string we ever compare (bounds every scan).
constexpr int kMaxFieldChars = 64;

enum class FieldKind { kRatio, kInt, kLayout };

struct FieldSpec {
  const char* name;
  FieldKind kind;
  int32_t pnmix_config::*member;  // the int32 member it fills (kInt, kLayout); high_ratio is the double
};

// Each generated field kind as a FieldKind and a member pointer (high_ratio, the double, has none).
#define PNMIX_FIELD_DESC_RATIO(name) {#name, FieldKind::kRatio, nullptr}
#define PNMIX_FIELD_DESC_INT(name) {#name, FieldKind::kInt, &pnmix_config::name}
#define PNMIX_FIELD_DESC_LAYOUT(name) {#name, FieldKind::kLayout, &pnmix_config::name}

// pnmix/config.py CONFIG_FIELDS, in its order (the pnmix_config struct's order too).
constexpr FieldSpec kConfigFields[PNMIX_NUM_CONFIG_FIELDS] = {
#define PNMIX_X(name, kind) PNMIX_FIELD_DESC_##kind(name),
    PNMIX_CONFIG_FIELDS(PNMIX_X)
#undef PNMIX_X
};
#undef PNMIX_FIELD_DESC_RATIO
#undef PNMIX_FIELD_DESC_INT
#undef PNMIX_FIELD_DESC_LAYOUT

// The pair_layout strings, indexed by their codes (PNMIX_PAIR_ADJACENT, PNMIX_PAIR_HALF).
constexpr const char* kPairLayoutNames[PNMIX_NUM_PAIR_LAYOUTS] = {
#define PNMIX_X(code, NAME, name) name,
    PNMIX_PAIR_LAYOUTS(PNMIX_X)
#undef PNMIX_X
};

// The name of a pair_layout code (the first layout for a code out of range: config_error refuses
// those before anything is serialized or printed).
inline const char* pair_layout_name(int32_t code) {
  return kPairLayoutNames[(code >= 0 && code < PNMIX_NUM_PAIR_LAYOUTS) ? code : 0];
}

namespace detail {

// Formats a one-line reason into err (always NUL-terminated when err_len > 0); returns false.
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
inline bool fail(char* err, size_t err_len, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, err_len, fmt, args);
    va_end(args);
  }
  return false;
}

// strlen that stops after `limit` characters: a name without a NUL in reach is "too long".
inline size_t bounded_length(const char* s, size_t limit) {
  size_t n = 0;
  while (n <= limit && s[n] != '\0') ++n;
  return n;
}

inline int find_config_field(const char* name) {
  const size_t n = bounded_length(name, kMaxFieldChars);
  if (n > (size_t)kMaxFieldChars) return -1;
  for (int i = 0; i < PNMIX_NUM_CONFIG_FIELDS; ++i)
    if (strlen(kConfigFields[i].name) == n && memcmp(kConfigFields[i].name, name, n) == 0) return i;
  return -1;
}

// int32 or int64 scalar -> int32 (range-checked); the parser sends INT attributes as kINT32.
inline bool read_int(const pnmix_field& f, int32_t* out, char* err, size_t err_len) {
  if (f.type == PNMIX_FIELD_INT32) {
    memcpy(out, f.data, sizeof(int32_t));
    return true;
  }
  if (f.type == PNMIX_FIELD_INT64) {
    int64_t v;
    memcpy(&v, f.data, sizeof(int64_t));
    if (v < INT32_MIN || v > INT32_MAX)
      return fail(err, err_len, "plugin field '%s' = %lld does not fit in int32", f.name, (long long)v);
    *out = (int32_t)v;
    return true;
  }
  return fail(err, err_len, "plugin field '%s' must be an integer (kINT32 or kINT64), got type %d", f.name,
              (int)f.type);
}

// float32 (ONNX FLOAT attribute) or float64 (our serialization) scalar, finite.
inline bool read_ratio(const pnmix_field& f, double* out, char* err, size_t err_len) {
  if (f.type == PNMIX_FIELD_FLOAT32) {
    float v;
    memcpy(&v, f.data, sizeof(float));
    *out = (double)v;
  } else if (f.type == PNMIX_FIELD_FLOAT64) {
    memcpy(out, f.data, sizeof(double));
  } else {
    return fail(err, err_len, "plugin field '%s' must be a float (kFLOAT32 or kFLOAT64), got type %d", f.name,
                (int)f.type);
  }
  if (!isfinite(*out)) return fail(err, err_len, "plugin field '%s' must be a finite number", f.name);
  return true;
}

// kCHAR of `length` bytes: the text is all of them, less one trailing NUL if there is one. A NUL
// anywhere else is part of the text, so "adjacent\0x" is refused rather than read as "adjacent".
inline bool read_layout(const pnmix_field& f, int32_t* out, char* err, size_t err_len) {
  if (f.type != PNMIX_FIELD_CHAR)
    return fail(err, err_len, "plugin field '%s' must be a string (kCHAR), got type %d", f.name, (int)f.type);
  if (f.length > kMaxFieldChars)
    return fail(err, err_len, "plugin field '%s' is %d characters long, at most %d allowed", f.name,
                (int)f.length, kMaxFieldChars);
  const char* text = (const char*)f.data;
  size_t n = (size_t)f.length;
  if (n > 0 && text[n - 1] == '\0') --n;
  for (int32_t code = 0; code < PNMIX_NUM_PAIR_LAYOUTS; ++code) {
    if (strlen(kPairLayoutNames[code]) == n && memcmp(kPairLayoutNames[code], text, n) == 0) {
      *out = code;
      return true;
    }
  }
  char shown[kMaxFieldChars + 1];
  memcpy(shown, text, n);
  shown[n] = '\0';
  for (size_t i = 0; i < n; ++i)
    if ((unsigned char)shown[i] < 0x20 || (unsigned char)shown[i] > 0x7e) shown[i] = '?';
  return fail(err, err_len, "plugin field 'pair_layout' must be one of " PNMIX_PAIR_LAYOUT_LIST ", got '%s'", shown);
}

inline size_t element_bytes(int32_t type) {
  switch (type) {
    case PNMIX_FIELD_FLOAT32: return 4;
    case PNMIX_FIELD_FLOAT64: return 8;
    case PNMIX_FIELD_INT32: return 4;
    case PNMIX_FIELD_INT64: return 8;
    case PNMIX_FIELD_CHAR: return 1;
    default: return 0;
  }
}

}  // namespace detail

// Parse a field collection into a config. Every CONFIG_FIELDS name must appear exactly once;
// scalars have length 1; the config must pass config_error. On failure returns false and writes
// a one-line reason into err; *out is then unspecified.
inline bool parse_config_fields(const pnmix_field* fields, int32_t nb_fields, pnmix_config* out, char* err,
                                size_t err_len) {
  using detail::fail;
  if (out == nullptr) return fail(err, err_len, "no config to fill");
  if (nb_fields < 0 || nb_fields > 4 * PNMIX_NUM_CONFIG_FIELDS)
    return fail(err, err_len, "plugin field collection has an implausible field count %d", (int)nb_fields);
  if (nb_fields > 0 && fields == nullptr)
    return fail(err, err_len, "plugin field collection claims %d fields but has no field array", (int)nb_fields);
  bool seen[PNMIX_NUM_CONFIG_FIELDS] = {false};
  pnmix_config c;
  memset(&c, 0, sizeof(c));
  for (int32_t i = 0; i < nb_fields; ++i) {
    const pnmix_field& f = fields[i];
    if (f.name == nullptr) return fail(err, err_len, "plugin field %d has no name", (int)i);
    const int which = detail::find_config_field(f.name);
    if (which < 0) {
      char shown[kMaxFieldChars + 1];
      const size_t n = detail::bounded_length(f.name, kMaxFieldChars);
      const size_t keep = n > (size_t)kMaxFieldChars ? (size_t)kMaxFieldChars : n;
      memcpy(shown, f.name, keep);
      shown[keep] = '\0';
      return fail(err, err_len, "unknown plugin field '%s'", shown);
    }
    if (seen[which]) return fail(err, err_len, "plugin field '%s' appears twice", f.name);
    seen[which] = true;
    if (detail::element_bytes(f.type) == 0)
      return fail(err, err_len, "plugin field '%s' has unsupported type %d", f.name, (int)f.type);
    if (f.data == nullptr) return fail(err, err_len, "plugin field '%s' has no data", f.name);
    const FieldKind kind = kConfigFields[which].kind;
    if (kind == FieldKind::kLayout) {
      if (f.length < 1) return fail(err, err_len, "plugin field '%s' has length %d", f.name, (int)f.length);
    } else if (f.length != 1) {
      return fail(err, err_len, "plugin field '%s' must hold exactly 1 value, has length %d", f.name,
                  (int)f.length);
    }
    const FieldSpec& spec = kConfigFields[which];
    const bool ok = kind == FieldKind::kRatio    ? detail::read_ratio(f, &c.high_ratio, err, err_len)
                    : kind == FieldKind::kLayout ? detail::read_layout(f, &(c.*spec.member), err, err_len)
                                                 : detail::read_int(f, &(c.*spec.member), err, err_len);
    if (!ok) return false;
  }
  for (int i = 0; i < PNMIX_NUM_CONFIG_FIELDS; ++i)
    if (!seen[i]) return fail(err, err_len, "plugin field '%s' is missing", kConfigFields[i].name);
  if (const char* bad = config_error(c)) return fail(err, err_len, "%s", bad);
  *out = c;
  return true;
}

// Fill storage with the fields that serialize config (high_ratio as float64, so the value
// survives exactly; pair_layout as a NUL-terminated string). The fields point into storage.
inline void serialize_config_fields(const pnmix_config& config, pnmix_field_storage* storage) {
  memset(storage, 0, sizeof(*storage));
  storage->high_ratio = config.high_ratio;
  for (int i = 0; i < PNMIX_NUM_CONFIG_FIELDS; ++i)
    if (kConfigFields[i].member != nullptr) storage->ints[i] = config.*kConfigFields[i].member;
  const char* layout = pair_layout_name(config.pair_layout);
  memcpy(storage->pair_layout, layout, strlen(layout) + 1);
  for (int i = 0; i < PNMIX_NUM_CONFIG_FIELDS; ++i) {
    pnmix_field& f = storage->fields[i];
    f.name = kConfigFields[i].name;
    switch (kConfigFields[i].kind) {
      case FieldKind::kRatio:
        f.data = &storage->high_ratio;
        f.type = PNMIX_FIELD_FLOAT64;
        f.length = 1;
        break;
      case FieldKind::kLayout:
        f.data = storage->pair_layout;
        f.type = PNMIX_FIELD_CHAR;
        f.length = (int32_t)strlen(layout) + 1;
        break;
      default:
        f.data = &storage->ints[i];
        f.type = PNMIX_FIELD_INT32;
        f.length = 1;
        break;
    }
  }
}

// The type a field is advertised with to TensorRT's ONNX parser (what the exporter writes).
inline int32_t advertised_type(int i) {
  switch (kConfigFields[i].kind) {
    case FieldKind::kRatio: return PNMIX_FIELD_FLOAT32;
    case FieldKind::kLayout: return PNMIX_FIELD_CHAR;
    default: return PNMIX_FIELD_INT32;
  }
}

}  // namespace pnmix

/* ---- C ABI of libpnmix_fields (plugins/trt/fields_abi.cpp), for tests and tools ---------- */
#if defined(__GNUC__)
#define PNMIX_FIELDS_API __attribute__((visibility("default")))
#else
#define PNMIX_FIELDS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Number of plugin fields, and the name / advertised type of field i (NULL / -1 out of range). */
PNMIX_FIELDS_API int32_t pnmix_fields_count(void);
PNMIX_FIELDS_API const char* pnmix_fields_name(int32_t i);
PNMIX_FIELDS_API int32_t pnmix_fields_type(int32_t i);
/* plugin version "1", namespace "" (export/ops.py), and the op types: which = 0 attention, 1 append (NULL otherwise). */
PNMIX_FIELDS_API const char* pnmix_fields_plugin_version(void);
PNMIX_FIELDS_API const char* pnmix_fields_plugin_namespace(void);
PNMIX_FIELDS_API const char* pnmix_fields_plugin_name(int32_t which);
/* Parse fields into *out: 0 on success, 1 on a bad collection (reason in err). */
PNMIX_FIELDS_API int32_t pnmix_fields_parse(const pnmix_field* fields, int32_t nb_fields, pnmix_config* out, char* err,
                           int32_t err_len);
/* Serialize *config into *storage (fields in storage->fields): 0, or 1 if the config is invalid. */
PNMIX_FIELDS_API int32_t pnmix_fields_serialize(const pnmix_config* config, pnmix_field_storage* storage, char* err,
                               int32_t err_len);
/* sizeof(pnmix_field_storage), so callers can check their struct mirrors this one. */
PNMIX_FIELDS_API int32_t pnmix_fields_storage_bytes(void);

#ifdef __cplusplus
}
#endif

#endif /* PNMIX_PLUGIN_FIELDS_H */
