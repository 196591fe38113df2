"""Reference VLMs and the split deployment pipeline (see ``docs/reference-models.md``).

Modules (all import torch/transformers/onnxruntime lazily, except ``parts`` which needs torch):

* ``task``: the synthetic caption task (images, tokenizer, eval set, ``caption_accuracy``)
* ``build``: the family table (``FAMILIES``: InternVL, Qwen2-VL, Qwen3-VL), configs of ``internvl-tiny`` /
  ``qwen2vl-tiny`` / ``qwen3vl-tiny``, buckets, static-shape constants, graph I/O names
* ``inputs``: pixel layouts, HF inputs, prefill ``position_ids`` (M-RoPE via ``get_rope_index``), rope delta,
  M-RoPE frequency layouts
* ``train``: deterministic CPU training (``scripts/train_reference.py``)
* ``load``: ``load_vlm(name_or_path)`` for the shipped names or any ``save_pretrained`` folder
* ``parts``: vision / prefill / decode torch wrappers (DeepStack inputs, M-RoPE layout override), additive masks
* ``manifest``: ``export.json`` of an export folder (``MANIFEST``, ``load_manifest``)
* ``export``: split static-shape ONNX export + verification
* ``scheduler``: the deployment loop (KV cache, positions / DeepStack / M-RoPE-layout knobs, teacher forcing,
  step-aware dumps)
* ``torch_generate``: the torch reference through the same loop, and HF ``generate``
* ``pipeline``: ``prepare`` / ``scheduler`` / ``evaluate`` for ``ivq demo``
* ``parts_dynamic`` (needs torch), ``export_dynamic``, ``scheduler_dynamic``: the HF-style split export with a
  dynamic KV cache (``past_key_values`` inputs, whole-cache ``present`` outputs) and its deployment loop
"""
