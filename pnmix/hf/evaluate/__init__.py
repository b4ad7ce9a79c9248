"""`pnmix eval MODEL`: KV-cache methods on a real model, scored against full precision (docs/EVAL.md).

The command is pnmix.hf.evaluate.command; the methods are methods.METHODS, one table; kv_bytes counts a
cache's bytes; prefill runs the shared prefill and hands it over; kl and passkey are the two tasks;
inputs reads the text, tokens and model; report draws the tables and the plot.

Every method is a named preset in METHODS, one table: transformers' DynamicCache (the reference),
PnMixCache with the manifest's config and with pn-mix configs that reproduce other schemes
(uniform 2-bit keys, KIVI), and transformers' QuantizedCache (quanto).

Protocol. The prefill attends in full precision under every cache (docs/METHOD.md section 2), so it is run
ONCE per text with a DynamicCache, and each method's fresh cache is handed that prefill's K/V
layer by layer through ``cache.update(k, v, layer_idx)``, exactly what the prefill forward call
would have handed it (tests/harness/test_eval.py checks the results are identical). Each method then runs
only its decode steps, one token per forward call, PnMixCache under the ``pnmix`` attention:

* task ``kl``: the text's first P tokens are the prefill, the next D are teacher-forced; step i's
  distribution is scored against the reference's: mean KL(p_ref || p), the perplexity of the true
  next tokens, top-1 agreement with the reference, decode tokens/s.
* task ``passkey``: a haystack of Hamlet with a pass-key sentence at a depth is the prefill, the
  question goes through the decode path token by token, then greedy generation; a trial is right
  when the first number generated is the key.
"""
