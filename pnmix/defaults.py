"""The commands' defaults, in one place for the CLI's options and the functions behind them
(pnmix.export, pnmix.verify, pnmix.bench). Plain values, no imports: the CLI
reads them without importing the heavy modules."""

EXPORT_MAX_SEQ_LEN = 4096  # cache capacity of an exported model, in tokens
EXPORT_BATCH = 1
EXPORT_OPSET = 18  # ONNX default-domain opset
# An LLM file's default opset: from 23 a prefill's causal attention is ONNX's Attention op (one
# fused kernel in ONNX Runtime) instead of MatMul, a mask and Softmax; `--opset 18` keeps those.
LLM_EXPORT_OPSET = 23
ATTENTION_OP_OPSET = 23
MODEL_SEED = 42  # the diagnostic model's weights
LLM_EXPORT_DTYPE = "fp32"  # `pnmix export --model`: the weights' dtype

VERIFY_LLM_PROMPT_TOKENS = 32  # `pnmix verify --model`: one prefill of this many tokens
VERIFY_LLM_DECODE_TOKENS = 8  # then this many greedy decode steps, each checked

BENCH_REPEATS = 20  # timed repetitions per implementation / decode steps
BENCH_BATCH_LENGTHS = (87, 423, 377, 947)  # `pnmix bench batch`: the prompts of the left-padded batch
BENCH_LLM_CONTEXTS = (512, 2048, 4096)  # `pnmix bench onnx --model`: contexts timed
DECODE_CONTEXT = 32768  # `pnmix bench decode`: tokens in the cache
DECODE_BATCH = 1
DECODE_Q_HEADS = 32
DECODE_KV_HEADS = 8
DECODE_HEAD_DIM = 128

EVAL_TASK = "kl"  # `pnmix eval`: a comma list of kl, passkey, passkey-long
EVAL_CONTEXTS = (1024,)  # task kl: prefill lengths P
EVAL_DECODE_TOKENS = 256  # task kl: teacher-forced decode steps D after each prefill
EVAL_LENGTHS = (1024, 2048, 4096, 8192)  # task passkey: sequence lengths in tokens
EVAL_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # task passkey: where the key sits, 0 (start) to 1 (end)
EVAL_TRIALS = 10  # task passkey: seeded keys per (length, depth) cell
EVAL_HAYSTACK = "classic"  # task passkey: classic (the repeated filler sentence) or text
EVAL_DTYPE = "fp32"  # the model's weights

TUNE_CONTEXT = 4096  # `pnmix tune`: the calibration prefill P
TUNE_DECODE_TOKENS = 128  # teacher-forced steps after it, scored against the reference
TUNE_BUDGET_EVALS = 24  # full candidate evaluations' worth of decode steps (the presets besides)
