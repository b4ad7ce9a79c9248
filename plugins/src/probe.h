// probe.h: register-resident multiply-add loops (probe_avx2.cc, probe_avx512.cc); each returns the
// multiply-adds done.
#ifndef PNMIX_SRC_PROBE_H
#define PNMIX_SRC_PROBE_H

#include <stdint.h>

namespace pnmix {

double int8_madds(int64_t iterations);
double fp32_madds(int64_t iterations);
double int8_madds_vnni(int64_t iterations);
double fp32_madds_avx512(int64_t iterations);

}  // namespace pnmix

#endif  // PNMIX_SRC_PROBE_H
