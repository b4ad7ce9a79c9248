"""Configurations that exercise every corner of the packed format, shared by the kernel tests of
every backend (and handy for checking a new backend): one table, so all backends face the same
cases."""

SMALL = dict(group_size=16, residual_size=24, sink_tokens=5)

# The non-default configuration of the verify checks: other pair layout, bit widths and sizes.
OTHER_CONFIG = dict(pair_layout="half", key_high_bits=4, key_low_bits=2, value_bits=4,
                    group_size=64, residual_size=96, sink_tokens=8, high_ratio=0.25)

KERNEL_CONFIGS = {
    "manifest": {},
    "small": SMALL,
    "other": OTHER_CONFIG,
    # 1-bit and 4-bit keys, 1-bit values in blocks of 8 channels
    "bits_4_1": dict(SMALL, key_high_bits=4, key_low_bits=1, value_bits=1, value_group_size=8),
    # codes that straddle bytes: 5/3-bit keys, 3-bit values, a group of 24 (not a power of two),
    # a residual much larger than a group
    "straddle": dict(group_size=24, residual_size=56, sink_tokens=3, key_high_bits=5,
                     key_low_bits=3, value_bits=3, value_group_size=16, pair_layout="half"),
    "all_high_8": dict(SMALL, high_ratio=1.0, key_high_bits=8, value_bits=8),
    "no_sink": dict(group_size=8, residual_size=8, sink_tokens=0, key_high_bits=2, key_low_bits=1),
}


def schedule_list_model(config, chunks):
    """SPEC section 2 in plain lists, the oracle for the cache's schedule: each token goes to the
    sink while it has room, else to the residual; after each append, while the residual holds
    >= residual_size tokens its oldest group_size become a group. Returns token positions
    (sink, groups, residual)."""
    sink, groups, residual, position = [], [], [], 0
    for n in chunks:
        for _ in range(n):
            (sink if len(sink) < config.sink_tokens else residual).append(position)
            position += 1
        while len(residual) >= config.residual_size:
            groups.append(residual[: config.group_size])
            del residual[: config.group_size]
    return sink, groups, residual
