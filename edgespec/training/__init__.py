"""Making specialized drafters, offline: the tooling beside the runtime.

* ``corpus``: text to learn from (the dataset-build wheel, the Python
  standard library, the user's files), with the benchmark suites held out;
* ``distill``: the target's next-token distributions over that text
  (teacher-forced, or on its own continuations), in checksummed shards;
* ``train``: a small drafter (PyTorch) trained on them and exported as a
  GGUF that both engines load (edgespec.drafters.specialized holds the
  contract between the file and the engine);
* ``moe_tools``: the expert cache's files (an upcycled or synthetic MoE,
  the low-precision sidecar), the offline half of edgespec.moe.

This package sits above the engine (distillation runs the target through
it); nothing in the runtime imports it.
"""
