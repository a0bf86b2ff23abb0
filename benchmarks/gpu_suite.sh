#!/usr/bin/env bash
# One command on a GPU machine that installs flashtile, runs the GPU tests and the benchmarks,
# and packs everything under $OUT into one archive, results.tgz (one file to copy back).
#   bash benchmarks/gpu_suite.sh [part ...]
# parts:
#   tests all_tests all_tests_xdist attention softmax softmax_tests tune_softmax staged_softmax
#   wide_bwd hopper alternatives pingpong_d256 consan consan_fp8 fp8_gluon fp8_verify profile_bwd deterministic
#   memory host training
#   parity_tests features generate few_rows decode decode_host decode_iam decode_ab tune_decode kvcache_tests
#   strided_tests fp8 ring io
# RING_GPUS=2 (on a machine with 2 GPUs) runs the ring part on that many processes.
# Each part runs under its own time limit, so one slow part cannot eat the others' time.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashtile-out}
RES="$OUT/results"
mkdir -p "$RES"
python3 -m pip install -q -e . --no-deps --no-build-isolation 2>&1 | tail -2
parts=${*:-tests attention softmax features decode fp8 ring io}
t0=$(date +%s)
# With pytest-timeout (on the GPU image), a test of the warp-specialised kernels that hangs on a
# barrier is killed after HANG_S (its worker, under xdist, which goes on with the others).
HANG_S=${HANG_S:-150}
HANG=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=$HANG_S --timeout_method=thread")
run() {  # run NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) at $(( $(date +%s) - t0 ))s"
  # SIGINT first: pytest and the benchmarks then print their summaries; SIGKILL 20 s later.
  timeout -s INT -k 20 "$limit" "$@" > "$RES/$name.log" 2>&1
  echo "    rc=$? $(tail -n 3 "$RES/$name.log" | tr '\n' ' ' | cut -c1-300)"
}
for part in $parts; do
  case $part in
    tests) run gpu_tests 420 python3 -m pytest tests -m gpu -q -p no:cacheprovider -p no:warnings ;;
    all_tests) run all_tests 590 python3 -m pytest tests -q -p no:cacheprovider -p no:warnings ;;  # unmarked tests run on CUDA too
    all_tests_xdist) run all_tests_xdist 540 python3 -m pytest tests -n 16 -v -rfE -p no:cacheprovider -p no:warnings
                     grep -E "FAILED|ERROR" "$RES/all_tests_xdist.log" | tail -40 ;;  # 340-450 s on an H200 host; -v names each test as it ends
    attention) run attention 420 python3 -m flashtile.bench.gpu --out "$RES" ;;
    softmax) run softmax 120 python3 -m flashtile.bench.softmax --out "$RES" ;;
    softmax_tests) run softmax_tests 220 python3 -m pytest tests/kernels/test_softmax_kernels.py -m gpu -q \
                     -p no:cacheprovider -p no:warnings ;;
    tune_softmax) run tune_softmax 200 python3 benchmarks/tune_softmax.py --out "$RES" --budget-s 150 \
                    --cols 65536 262144 1048576 4194304 --configs "" "coop_pack=0" "cooperative_max=0" \
                    "coop_fwd_min_bytes=0" "coop_bwd_block=8192" "coop_fwd_maxnreg=80" ;;
    staged_softmax)  # the shared-memory softmax (default: backward, rows of 2 MB+): GPU tests, A/B against the other paths
      run staged_tests 240 python3 -m pytest tests/kernels/hopper/test_staged_softmax.py -m gpu -q -p no:cacheprovider \
        -p no:warnings $HANG
      run tune_staged 200 python3 benchmarks/tune_softmax.py --out "$RES" --budget-s 150 \
        --cols 16384 32768 65536 262144 1048576 4194304 --configs "" "staged=1" "staged=1,staged_min_bytes=0" ;;
    wide_bwd)  # the backward of head dims 129-256 (forced Gluon only) and its dQ pass: GPU tests, then their
               # alternatives against tl.* and cuDNN
      run wide_bwd_tests 420 python3 -m pytest tests/kernels/hopper/test_attention_bwd_wide.py \
        tests/kernels/hopper/test_attention_bwd_dq.py -m gpu -q -n 4 -p no:cacheprovider -p no:warnings $HANG
      dq_variants=$(python3 -c "from flashtile.kernels.hopper import attention_bwd_dq as dq, attention_bwd_wide as w
print(*('dq:' + a for a in dq.ALTERNATIVES), *('wide:' + a for a in w.ALTERNATIVES))")
      run wide_bwd_ab 240 python3 benchmarks/bench_hopper_bwd.py --headdims 256 --seqlens 1024 4096 16384 --variants \
        $dq_variants --out "$RES/hopper_bwd_wide.jsonl" ;;
    strided_tests) run strided_tests 120 python3 -m pytest tests/test_kvcache.py tests/kernels/test_attention_kernels.py \
                     -q -p no:cacheprovider -p no:warnings -k "strided or views or non_contiguous" ;;
    kvcache_tests) run kvcache_tests 170 python3 -m pytest tests/test_kvcache.py -q -p no:cacheprovider -p no:warnings ;;
    hopper) run hopper_tests 360 python3 -m pytest tests/kernels/hopper tests/kernels/test_engine.py -n 8 -q \
              -p no:cacheprovider -p no:warnings $HANG
            run hopper_consan 420 env TRITON_INSTRUMENTATION_MODE=consan python3 benchmarks/hopper_consan.py fwd bwd
            run hopper_ab 360 python3 benchmarks/bench_hopper.py --headdims 128 64 256 --seqlens 1024 4096 16384 \
              --out "$RES/hopper_fwd.jsonl"  # the default, attention_fwd.ALTERNATIVES and the peers
            run hopper_bwd_ab 300 python3 benchmarks/bench_hopper_bwd.py --out "$RES/hopper_bwd.jsonl" ;;
    alternatives)  # the Hopper kernels' alternative configurations (each module's ALTERNATIVES): timed, then checked (one call)
      run alternative_fwd 130 python3 benchmarks/bench_hopper.py --headdims 64 128 --seqlens 1024 4096 16384 \
        --peers triton sdpa_cudnn --out "$RES/hopper_fwd.jsonl"
      run alternative_bwd 160 python3 benchmarks/bench_hopper_bwd.py --seqlens 1024 4096 16384 --peers triton sdpa_cudnn \
        --out "$RES/hopper_bwd.jsonl"
      run alternative_fp8 90 python3 benchmarks/bench_fp8.py --headdims 64 128 --seqlens 4096 16384 \
        --impls bf16,fp8_gluon,fp8_gluon_bn64 --out "$RES/fp8_gluon_variants" \
        --gluon-variants $(python3 -c "from flashtile.kernels.hopper import attention_fp8 as m; print(*m.ALTERNATIVES)")
      run alternative_tests 180 python3 -m pytest tests/kernels/hopper tests/kernels/test_attention_fp8.py -m gpu -n 12 \
        -q -p no:cacheprovider -p no:warnings ;;
    pingpong_d256)  # d = 256 non-causal with and without turns, two runs: the check of call_config's key-count
                    # rule (no turns from NO_TURNS_MIN_KEYS keys, H100 runs in docs/tuning.md)
      for round in 1 2; do
        run pingpong_d256_$round 120 python3 benchmarks/bench_hopper.py --headdims 256 --seqlens 2048 4096 8192 16384 \
          --causal 0 --variants pingpong=0 pingpong=1 --peers sdpa_cudnn --out "$RES/pingpong_d256_$round.jsonl"
      done ;;
    consan) run hopper_consan 420 env TRITON_INSTRUMENTATION_MODE=consan python3 benchmarks/hopper_consan.py fwd bwd ;;
    consan_fp8) run hopper_consan_fp8 420 env TRITON_INSTRUMENTATION_MODE=consan python3 benchmarks/hopper_consan.py fp8 ;;
    fp8_gluon)  # the Gluon FP8 forward: its GPU tests (alternatives included) with ConSan beside them, then the
                # default against each of attention_fp8.ALTERNATIVES, the tl.* kernel and bf16, best of two in turns
      env TRITON_INSTRUMENTATION_MODE=consan timeout 330 python3 benchmarks/hopper_consan.py fp8 \
        > "$RES/hopper_consan_fp8.log" 2>&1 &
      run fp8_gluon_tests 240 python3 -m pytest tests/kernels/test_attention_fp8.py -m gpu -k gluon -n 11 -q \
        -p no:cacheprovider -p no:warnings $HANG
      wait
      echo "    consan: $(grep -c ': ok' "$RES/hopper_consan_fp8.log") ok, $(tail -n 1 "$RES/hopper_consan_fp8.log" | cut -c1-200)"
      run fp8_gluon_ab 240 python3 benchmarks/bench_fp8.py --headdims 128 256 --seqlens 4096 16384 --rounds 2 \
        --impls bf16,fp8,fp8_pretransposed,fp8_gluon --out "$RES/fp8_gluon_ab" \
        --gluon-variants $(python3 -c "from flashtile.kernels.hopper import attention_fp8 as m; print(*m.ALTERNATIVES)") ;;
    fp8_verify)  # every FP8 GPU test (both engines, the launch plans' bits) with ConSan beside them and the
                 # accuracy benchmark, then the FP8 benchmark (best of two in turns, the GPU idle); the limits add
                 # up to 500 s, one call.  The FP8 host time per call: part decode_host (its first run on a fresh
                 # machine compiles the decode kernels, over 70 s)
      env TRITON_INSTRUMENTATION_MODE=consan timeout 360 python3 benchmarks/hopper_consan.py fp8 \
        > "$RES/hopper_consan_fp8.log" 2>&1 &
      run fp8_tests 240 python3 -m pytest tests/kernels/test_attention_fp8.py tests/test_fp8.py tests/test_host_path.py \
        tests/kernels/test_engine.py -m "gpu or not gpu" -n 11 -q -p no:cacheprovider -p no:warnings $HANG
      run fp8_accuracy 60 python3 benchmarks/fp8_accuracy.py --out "$RES"
      wait
      echo "    consan: $(grep -c ': ok' "$RES/hopper_consan_fp8.log") ok, $(tail -n 1 "$RES/hopper_consan_fp8.log" | cut -c1-200)"
      run fp8 140 python3 benchmarks/bench_fp8.py --headdims 128 256 --seqlens 1024 4096 16384 --rounds 2 \
        --out "$RES/fp8_verify" ;;  # a subset of the committed sweep (part fp8 and bench_fp8.py's defaults)
    profile_bwd) run profile_fwd_bwd 150 python3 benchmarks/profile_fwd_bwd.py --seqlens 512 1024 2048 16384 --causal 0 1 \
                   --out "$RES/profile_fwd_bwd.jsonl" ;;  # kernels and idle time of one forward + backward
    host) run host_fwd_bwd 120 python3 benchmarks/profile_host_fwd_bwd.py --out "$RES/host_fwd_bwd.jsonl" ;;  # host us per call
    training) run training 240 python3 -m flashtile.bench.gpu --out "$RES/training" --compare flashtile_triton,sdpa_cudnn \
                --headdims 64 128 --modes fwd_bwd --no-memory ;;  # the standard benchmark's forward + backward rows
    deterministic) run deterministic 200 python3 benchmarks/bench_deterministic.py --out "$RES/deterministic.jsonl" ;;
    memory) run memory 120 python3 -m flashtile.bench.gpu --out "$RES/memory" --compare flashtile_triton,sdpa_cudnn \
              --headdims 128 --seqlens 16384 --modes fwd ;;  # peak extra memory of fwd+bwd, N = 1k-32k
    parity_tests) run parity_tests 240 python3 -m pytest tests/test_kvcache_rotary.py tests/test_kvcache_leftpad.py \
                    tests/test_varlen_paged.py tests/kernels/test_varlen_bounds.py tests/test_rotary.py tests/test_packed.py \
                    -q -p no:cacheprovider -p no:warnings ;;  # unmarked kernel tests run on CUDA too
    features) run features 150 python3 -m flashtile.bench.features --out "$RES" ;;
    generate) run generate 200 python3 benchmarks/bench_generate.py --out "$RES" ;;
    few_rows) run few_rows 150 python3 benchmarks/bench_few_rows.py --out "$RES" ;;
    decode) run decode 240 python3 -m flashtile.bench.decode --out "$RES" ;;
    decode_host) run decode_host 120 python3 benchmarks/profile_decode_host.py --out "$RES"
                 run decode_quick 150 python3 -m flashtile.bench.decode --out "$RES/decode_quick" --batches 1 8 \
                   --caches 8192 32768 --impls flashtile flashtile_paged16 flashtile_paged256 sdpa_flash sdpa_cudnn ;;
    decode_iam) for pdl in 1 0; do  # the whole decode sweep, launches blocking, PDL on and off: a memory-error check
                  run decode_iam_pdl$pdl 100 env CUDA_LAUNCH_BLOCKING=1 python3 benchmarks/tune_decode.py --batches 1 8 32 \
                    --caches 1024 8192 32768 --paged 0 16 --block-n 0 --warps 4 --stages 3 --extra pdl=$pdl; done ;;
    decode_ab)  # paged caches' pipelining depth and the eager merge in the split kernel, each against the default.
                # Offline (decode_register_report.compile_split), a 16-row-page cache with 64-key tiles holds one K and
                # one V buffer at 3 stages (the block-table load takes a stage; a contiguous cache holds two) and two at
                # 5; with 128-key tiles its block-table load stays synchronous in the loop.
      run decode_ab_paged 170 python3 benchmarks/tune_decode.py --batches 1 8 --caches 8192 32768 --paged 0 16 256 \
        --block-n 0 64 128 --warps 4 --stages 3 5 --out "$RES/decode_ab_paged.jsonl"
      for ml in 16 64; do  # merge_last_max_splits: 16 (the default) and 64, eager and CUDA-graph columns
        run decode_ab_merge$ml 90 env FLASHTILE_DECODE_TUNING=merge_last_max_splits=$ml python3 -m flashtile.bench.decode \
          --batches 1 8 --caches 4096 32768 --impls flashtile flashtile_paged16 sdpa_cudnn --out "$RES/decode_ab_merge$ml"
      done ;;
    tune_decode) run tune_decode 240 python3 benchmarks/tune_decode.py --caches 8192 32768 --paged 0 16 --warps 4 \
                   --stages 2 3 4 --extra programs_per_sm=1 programs_per_sm=2 --out "$RES/tune_decode.jsonl" ;;
    fp8) run fp8 240 python3 benchmarks/bench_fp8.py --headdims 64 128 256 --seqlens 4096 8192 16384 --out "$RES"
         run fp8_repeat 90 python3 benchmarks/bench_fp8.py --headdims 128 --seqlens 4096 8192 16384 \
           --impls bf16,fp8_pretransposed --out "$RES/fp8_repeat"  # the run-to-run spread
         run fp8_accuracy 60 python3 benchmarks/fp8_accuracy.py --out "$RES"
         run fp8_gluon_variants 150 python3 benchmarks/bench_fp8.py --headdims 64 128 --seqlens 4096 16384 \
           --impls bf16,fp8_gluon,fp8_gluon_bn64 --out "$RES/fp8_gluon_variants" \
           --gluon-variants $(python3 -c "from flashtile.kernels.hopper import attention_fp8 as m; print(*m.ALTERNATIVES)") ;;
    ring) run ring 90 python3 -m torch.distributed.run --standalone --nproc_per_node=${RING_GPUS:-1} benchmarks/bench_ring.py \
            --seqlens 32k 64k 128k --out "$RES" ;;
    io) run iomodel 120 python3 benchmarks/measure_io.py --out "$RES" ;;
    *) echo "unknown part $part" ;;
  esac
  tar -czf "$OUT/results.tgz" -C "$OUT" results  # after every part: a call cut short keeps what ran
done
rm -rf "$RES"
echo "packed $OUT/results.tgz after $(( $(date +%s) - t0 ))s"
