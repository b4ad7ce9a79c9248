"""The commands' defaults, in one place for the CLI's options and the functions behind them
(pnmix.export.exporter, pnmix.bench.onnx, pnmix.bench). Plain numbers, no imports: the CLI
reads them without importing the heavy modules."""

EXPORT_MAX_SEQ_LEN = 4096  # cache capacity of an exported model, in tokens
EXPORT_BATCH = 1
EXPORT_OPSET = 18  # ONNX default-domain opset
MODEL_SEED = 42  # the diagnostic model's weights

BENCH_REPEATS = 20  # timed repetitions per implementation / decode steps
DECODE_CONTEXT = 32768  # `pnmix bench decode`: tokens in the cache
DECODE_BATCH = 1
DECODE_Q_HEADS = 32
DECODE_KV_HEADS = 8
DECODE_HEAD_DIM = 128
