"""Benchmarks: CPU (:mod:`flashtile.bench.cpu`) and GPU (:mod:`flashtile.bench.gpu`).

Records are dicts written one per line to JSONL files (:func:`flashtile.bench.common.write_jsonl`);
each carries the environment it was measured in (:func:`flashtile.bench.common.environment`).
Nothing heavy is imported here, so ``flashtile.bench.cpu`` loads without triton or CUDA.
"""
