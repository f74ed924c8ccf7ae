"""The models a scheduler runs, behind one protocol (``protocol.Model``): ``tiny``
(the seeded torch LM and the stub), ``hf`` (a Hugging Face causal LM from a local
directory; needs the ``[hf]`` extra, imported only when used), ``loading`` (the
spec that travels to a scheduler process, and its loader), ``files``,
``tiny_hf`` (a tiny random HF model for tests) and ``sampling``. Imports nothing
of ``scheduler`` but its errors."""
