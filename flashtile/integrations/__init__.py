"""Adapters that plug flashtile into other libraries.

Each adapter is a submodule that imports its library on first use; importing ``flashtile``
or this package imports none of them.

* :mod:`flashtile.integrations.transformers` -- a Hugging Face ``transformers`` attention
  backend: ``import flashtile.integrations.transformers`` registers it, then
  ``AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")``
  (``pip install 'flashtile[hf]'``).
"""
