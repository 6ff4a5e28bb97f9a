"""What runs an evaluation's cases, behind one contract (:class:`.base.Engine`), driven by
:func:`longreach.eval.runner.run`:

* :mod:`.transformers`: the model in this process (the default);
* :mod:`.vllm`: vLLM's offline engine with longreach's plugin (``--engine vllm``);
* :mod:`.server`: an OpenAI-compatible server (``--server URL``).
"""

ENGINES = ("transformers", "vllm")  # what --engine takes (--server URL is the third)
