// libpnmix_fields: the C ABI over pnmix/plugin_fields.h, so tests (ctypes) and tools run the very
// parsing and serialization code the TensorRT plugins compile, on a machine without TensorRT.
#include "pnmix/plugin_fields.h"

extern "C" {

int32_t pnmix_fields_count(void) { return PNMIX_NUM_CONFIG_FIELDS; }

const char* pnmix_fields_name(int32_t i) {
  return (i >= 0 && i < PNMIX_NUM_CONFIG_FIELDS) ? pnmix::kConfigFields[i].name : nullptr;
}

int32_t pnmix_fields_type(int32_t i) {
  return (i >= 0 && i < PNMIX_NUM_CONFIG_FIELDS) ? pnmix::advertised_type(i) : -1;
}

const char* pnmix_fields_plugin_version(void) { return pnmix::kPluginVersion; }

const char* pnmix_fields_plugin_namespace(void) { return pnmix::kPluginNamespace; }

const char* pnmix_fields_plugin_name(int32_t which) {
  if (which == 0) return pnmix::kAttentionPluginName;
  if (which == 1) return pnmix::kAppendPluginName;
  return nullptr;
}

int32_t pnmix_fields_parse(const pnmix_field* fields, int32_t nb_fields, pnmix_config* out, char* err,
                           int32_t err_len) {
  const size_t room = err_len > 0 ? (size_t)err_len : 0;
  return pnmix::parse_config_fields(fields, nb_fields, out, err, room) ? 0 : 1;
}

int32_t pnmix_fields_serialize(const pnmix_config* config, pnmix_field_storage* storage, char* err,
                               int32_t err_len) {
  const size_t room = err_len > 0 ? (size_t)err_len : 0;
  if (config == nullptr || storage == nullptr) {
    pnmix::detail::fail(err, room, "pnmix_fields_serialize needs a config and a storage");
    return 1;
  }
  // Never serialize what parse would refuse: an engine must not carry an invalid config.
  if (const char* bad = pnmix::config_error(*config)) {
    pnmix::detail::fail(err, room, "%s", bad);
    return 1;
  }
  pnmix::serialize_config_fields(*config, storage);
  return 0;
}

int32_t pnmix_fields_storage_bytes(void) { return (int32_t)sizeof(pnmix_field_storage); }

}  // extern "C"
