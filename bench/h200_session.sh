#!/usr/bin/env bash
# One batched session on the H200 (device tool): GPU tests, then the GPU benchmarks.
# Expects the wheels of the packages the device lacks in .whl/ (see bench/README.md).
# Usage: bash bench/h200_session.sh [stage ...]   stages: tests timeline-tests instrument decode tune profile launch cpuprof async spec specphases specgraph structured kernelwin overhead eventcost overhead-il overhead-hb mixed phases ops e2e-short e2e-long e2etrace sampled samplekernel gemm decvar hostbound e2e-8b repro begins specdev specexact overhead-ab overhead-begins repro-digest cold poll-ab split poll-chunk-ab core-ab
set -uo pipefail
OUT=${OUT:-out/h200}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# The compiled stage core (instrument/native.py) for this machine's Python; without it the device
# timeline runs its Python stage classes (every trace's metadata says which: stage_core).
python3 -m instrument.native build > "$OUT/stage_core_build.log" 2>&1 && echo "stage core: $(python3 -m instrument.native status)" || { echo "stage core not built:"; cat "$OUT/stage_core_build.log"; }
stages=${*:-tests instrument decode async}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for stage in $stages; do
  echo "=== $stage"
  case $stage in
    tests) timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/dashboard tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    timeline-tests) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/instrument tests/engine/test_graph_stamps_gpu.py tests/engine/test_kernel_window_gpu.py tests/engine/test_runner_gpu.py 2>&1 | tee "$OUT/timeline_gpu_tests.log" | tail -12 ;;
    instrument) timeout 120 python3 bench/bench_gpu_instrument.py --steps 1000 --json "$OUT/gpu_instrument.json" 2>&1 | tee "$OUT/gpu_instrument.log" ;;
    decode) mkdir -p "$OUT/kineto" && timeout 330 python3 bench/bench_decode.py --kineto-dir "$OUT/kineto" --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | grep -v "^     " | tail -14; tar czf "$OUT/kineto.tgz" -C "$OUT" kineto && rm -rf "$OUT/kineto" ;;
    tune) timeout 240 python3 bench/tune_decode_attention.py --block-n 32,64,128 --warps 2,4,8 --stages 2,3 --json "$OUT/tune_attention.json" 2>&1 | tee "$OUT/tune_attention.log" | grep -v "^    " ;;
    profile) timeout 120 python3 bench/bench_decode.py --profile --batches 256 --json "$OUT/decode_profile.json" 2>&1 | tee "$OUT/decode_profile.log" | tail -22 ;;
    async) timeout 240 python3 bench/bench_async.py --json "$OUT/async.json" 2>&1 | tee "$OUT/async.log" | tail -10 ;;
    spec) nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu --format=csv -lms 500 > "$OUT/spec_gpu_clocks.csv" 2>&1 & smi=$!; timeout ${SPEC_TIMEOUT:-450} python3 bench/bench_spec.py --device cuda --dtype bfloat16 --warm-repeat 2 --min-run-s 10 --time-budget-s ${SPEC_BUDGET_S:-300} ${SPEC_ARGS:-} --json "$OUT/spec_bfloat16.json" 2>&1 | tee "$OUT/spec_bfloat16.log" | grep -v "^  round" | tail -24
          if [ "${SPEC_FP32:-1}" = 1 ]; then timeout 130 python3 bench/bench_spec.py --device cuda --dtype float32 --rounds 1 --repeat 1 --warm-repeat 1 ${SPEC_ARGS:-} --json "$OUT/spec_float32.json" 2>&1 | tee "$OUT/spec_float32.log" | tail -12; echo "fp32 token check rc=${PIPESTATUS[0]}"; else echo "fp32 token check skipped (SPEC_FP32=0)"; fi; kill $smi 2>/dev/null ;;
    specgraph) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_spec_graphs_gpu.py 2>&1 | tee "$OUT/spec_graphs_gpu.log" | tail -8
      timeout ${SPECGRAPH_TIMEOUT:-420} python3 bench/bench_spec_graphs.py --json "$OUT/spec_graphs.json" ${SPECGRAPH_ARGS:-} 2>&1 | tee "$OUT/spec_graphs.log" | tail -24 ;;
    structured) timeout 300 python3 bench/bench_structured.py --model-config ${STRUCTURED_MODEL:-qwen3-8b} --dtype ${STRUCTURED_DTYPE:-bfloat16} --tokenizer samples/models/pycoder-14m --repeat 8 --json "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" | tail -16 ;;
    launch) for b in 1 256; do timeout 150 python3 bench/launch_breakdown.py --batch $b ${LAUNCH_ARGS:-} 2>&1 | tee "$OUT/launch_b$b.log" | head -60; done ;;
    cpuprof) for b in 1 256; do timeout 150 python3 bench/profile_cpu_step.py --batch $b --top 25 > "$OUT/cpuprof_b$b.log" 2>&1; grep -E "ms per step|graph.replay" "$OUT/cpuprof_b$b.log"; done ;;
    mixed) timeout 540 python3 bench/bench_mixed_step.py --profile --json "$OUT/mixed_step.json" 2>&1 | tee "$OUT/mixed_step.log" | tail -70 ;;
    kernelwin) timeout 240 python3 bench/bench_kernel_window.py --out "$OUT/kernel_window.json" --keep-trace "$OUT/kernel_window.pftrace" ${KW_ARGS:-} 2>&1 | tee "$OUT/kernel_window.log" | tail -30 ;;
    overhead) timeout 560 python3 bench/bench_trace_overhead.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --min-run-s 10 --out "$OUT/trace_overhead.json" ${OVERHEAD_ARGS:-} 2>&1 | tee "$OUT/trace_overhead.log" | tail -30 ;;
    eventcost) timeout 120 python3 bench/_event_cost.py --json "$OUT/event_costs.json" 2>&1 | tee "$OUT/event_costs.log" ;;
    overhead-il) timeout 290 python3 bench/bench_trace_overhead.py --interleaved --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --min-run-s ${IL_RUN_S:-75} --block-steps ${IL_BLOCK_STEPS:-256} ${OVERHEAD_ARGS:-} --out "$OUT/trace_overhead_il${IL_TAG:-}.json" 2>&1 | tee "$OUT/trace_overhead_il${IL_TAG:-}.log" | tail -20 ;;
    overhead-hb) timeout ${HB_TIMEOUT:-250} python3 bench/bench_trace_overhead.py --interleaved --device cuda --dtype bfloat16 --model samples/models/pycoder-14m --num-requests 2048 --in-len 32 --out-len 128 --max-num-seqs 256 --min-run-s ${HB_RUN_S:-40} --block-steps ${IL_BLOCK_STEPS:-256} ${HB_ARGS:---modes off,trace --time-records} --out "$OUT/trace_overhead_hostbound${IL_TAG:-}.json" 2>&1 | tee "$OUT/trace_overhead_hostbound${IL_TAG:-}.log" | tail -12 ;;
    phases) timeout ${PHASES_TIMEOUT:-300} python3 bench/host_phases.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --batch 256 --in-len 128 --out-len 128 ${PHASES_ARGS:-} --json "$OUT/host_phases.json" 2>&1 | tee "$OUT/host_phases.log" | tail -20 ;;
    specphases) for v in none eagle:3 mtp:3 draft:2 ngram:1; do spec=(); [ $v != none ] && spec=(--spec $v)
        timeout ${SPECPHASES_TIMEOUT:-110} python3 bench/host_phases.py --device cuda --dtype bfloat16 --model samples/models/pycoder-14m --batch 64 --workload samples/workloads/pycode_prompts.jsonl --out-len 128 --runs 3 "${spec[@]}" ${SPECPHASES_ARGS:-} --json "$OUT/host_phases_spec_${v/:/k}.json" 2>&1 | tee "$OUT/host_phases_spec_${v/:/k}.log" | sed -n '/cpu clock/,/host\/tok/p'; done ;;
    ops) timeout 300 python3 bench/count_step_ops.py --device cuda --dtype bfloat16 --model samples/models/pycoder-14m --batch 64 ${OPS_ARGS:-} 2>&1 | tee "$OUT/step_ops.log" | tail -20 ;;
    e2e-short) timeout 590 python3 bench/bench_e2e.py --device cuda --workloads 256x128-128 ${E2E_ARGS:-} --out "$OUT/e2e_256x128-128.json" 2>&1 | tee "$OUT/e2e_short.log" | tail -14 ;;
    e2e-long) timeout 590 python3 bench/bench_e2e.py --device cuda --workloads 1024x128-512 ${E2E_ARGS:-} --out "$OUT/e2e_1024x128-512.json" 2>&1 | tee "$OUT/e2e_long.log" | tail -14 ;;
    repro) timeout 460 python3 bench/repro_spec_assert.py ${REPRO_ARGS:-} --json "$OUT/repro_spec_assert.json" 2>&1 | tee "$OUT/repro_spec_assert.log" | tail -150 ;;
    e2etrace) run=(python3 -m stepscope.cli run --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --max-num-seqs 256 --workload "synthetic:n=1024,in=128-128,out=512-512,seed=0" --no-progress)
        timeout 150 "${run[@]}" --trace "$OUT/e2e_long.pftrace" 2>&1 | tee "$OUT/e2e_long_run.log" | head -8
        timeout 100 python3 -m stepscope.cli analyze "$OUT/e2e_long.pftrace" > "$OUT/e2e_long_analyze.txt" 2>&1; head -45 "$OUT/e2e_long_analyze.txt"
        timeout 150 "${run[@]}" --trace "$OUT/e2e_long_kw.pftrace" --trace-kernels ${E2ETRACE_KSTEPS:-1500:1520} 2>&1 | head -4
        timeout 100 python3 -m stepscope.cli analyze --window ${E2ETRACE_KSTEPS:-1500:1520} "$OUT/e2e_long_kw.pftrace" > "$OUT/e2e_long_kw_analyze.txt" 2>&1; sed -n '1,/^blame/p' "$OUT/e2e_long_kw_analyze.txt" | head -60 ;;
    hostbound) run=(python3 -m stepscope.cli run --device cuda --dtype bfloat16 --model samples/models/pycoder-14m --max-num-seqs 64 --workload "synthetic:n=1024,in=32-32,out=128-128,seed=0" --no-progress ${HOSTBOUND_ARGS:-})
        hb=hostbound${HOSTBOUND_TAG:-}
        timeout 150 "${run[@]}" --trace "$OUT/$hb.pftrace" --trace-kernels ${HOSTBOUND_KSTEPS:-400:440} 2>&1 | tee "$OUT/${hb}_run.log" | head -8
        timeout 100 python3 -m stepscope.cli analyze "$OUT/$hb.pftrace" > "$OUT/${hb}_analyze.txt" 2>&1; echo "analyze rc=$?"; head -40 "$OUT/${hb}_analyze.txt"
        timeout 100 python3 -m stepscope.cli analyze --window ${HOSTBOUND_KSTEPS:-400:440} "$OUT/$hb.pftrace" > "$OUT/${hb}_kw_analyze.txt" 2>&1; sed -n '1,/^blame/p' "$OUT/${hb}_kw_analyze.txt" | head -50
        [ "${HOSTBOUND_KEEP:-1}" = 1 ] || rm -f "$OUT/$hb.pftrace" ;;
    sampled) timeout ${SAMPLED_TIMEOUT:-300} python3 bench/bench_sampled_trace.py --device cuda ${SAMPLED_ARGS:-} --out "$OUT/sampled_trace.json" 2>&1 | tee "$OUT/sampled_trace.log" | tail -16 ;;
    samplekernel) timeout ${SAMPLEK_TIMEOUT:-150} python3 bench/bench_sample_kernel.py --device cuda ${SAMPLEK_ARGS:-} --json "$OUT/sample_kernel.json" 2>&1 | tee "$OUT/sample_kernel.log" | tail -40 ;;
    decvar) timeout ${DECVAR_TIMEOUT:-300} python3 bench/bench_decode_variants.py --budget-s ${DECVAR_BUDGET_S:-240} ${DECVAR_ARGS:-} --json "$OUT/decode_variants.json" 2>&1 | tee "$OUT/decode_variants.log" | tail -60 ;;
    gemm) timeout ${GEMM_TIMEOUT:-330} python3 bench/bench_gemm.py ${GEMM_ARGS:-} --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" | tail -20 ;;
    begins) for kind in device host; do  # --trace-begins both: derived vs recorded device begins (docs/design.md §4.3)
        if [ $kind = device ]; then m=(--model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --max-num-seqs 256 --workload "synthetic:n=1024,in=128-128,out=128-128,seed=0")
        else m=(--model samples/models/pycoder-14m --max-num-seqs 256 --workload "synthetic:n=2048,in=32-32,out=128-128,seed=0"); fi
        timeout ${BEGINS_TIMEOUT:-150} python3 -m stepscope.cli run --device cuda --dtype bfloat16 "${m[@]}" --no-progress --trace "$OUT/begins_both_$kind.pftrace" --trace-begins both > "$OUT/begins_run_$kind.log" 2>&1; head -4 "$OUT/begins_run_$kind.log"
        timeout 120 python3 bench/bench_derived_begins.py "$OUT/begins_both_$kind.pftrace" --json "$OUT/derived_begins_$kind.json" 2>&1 | tee "$OUT/derived_begins_$kind.log" | tail -10; done ;;
    specdev) ng=(--spec-method ngram --num-spec-tokens ${SPECDEV_K:-3})  # async vs --spec-sync-accepted where the device is the bottleneck (issue 19)
        if [ "${SPECDEV_E2E:-1}" = 1 ]; then timeout ${SPECDEV_TIMEOUT:-330} python3 bench/bench_e2e.py --device cuda --workloads ${SPECDEV_WL:-256x128-128} --no-hf --no-async-off --rounds 3 --flags-ab "ngram=${ng[*]}" --flags-ab "ngram_sync=${ng[*]} --spec-sync-accepted" --out "$OUT/e2e_spec_devbound.json" 2>&1 | tee "$OUT/e2e_spec_devbound.log" | tail -8; fi
        run=(python3 -m stepscope.cli run --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --max-num-seqs 256 --workload "synthetic:n=${SPECDEV_N:-512},in=128-128,out=256-256,seed=0" --no-progress "${ng[@]}")
        timeout 100 "${run[@]}" --trace "$OUT/specdev_async.pftrace" 2>&1 | head -6
        timeout 100 "${run[@]}" --spec-sync-accepted --trace "$OUT/specdev_sync.pftrace" 2>&1 | head -6
        timeout 100 python3 -m stepscope.cli compare "$OUT/specdev_sync.pftrace" "$OUT/specdev_async.pftrace" > "$OUT/specdev_compare.txt" 2>&1; echo "compare rc=$?"; head -30 "$OUT/specdev_compare.txt"
        timeout 100 python3 -m stepscope.cli analyze "$OUT/specdev_sync.pftrace" > "$OUT/specdev_sync_analyze.txt" 2>&1; head -12 "$OUT/specdev_sync_analyze.txt"
        gzip -f "$OUT/specdev_async.pftrace" "$OUT/specdev_sync.pftrace"; ls -la "$OUT"/specdev_* ;;
    specexact) dt=${SPECEXACT_DTYPE:-float32}  # every method's greedy tokens against none's under --batch-invariant (issue 19)
        timeout ${SPECEXACT_TIMEOUT:-300} python3 bench/bench_spec.py --device cuda --dtype $dt --rounds 1 --repeat 1 --warm-repeat 1 --batch-invariant --check-tokens --strict-tokens ${SPEC_ARGS:---variants none,ngram:1,draft:2,eagle:3,mtp:3,eagle:3:sync} --json "$OUT/spec_${dt}_invariant.json" 2>&1 | tee "$OUT/spec_${dt}_invariant.log" | tail -16; echo "strict token check rc=${PIPESTATUS[0]}"
        if [ "${SPECEXACT_TESTS:-1}" = 1 ]; then timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_batch_invariant_gpu.py 2>&1 | tee "$OUT/batch_invariant_gpu.log" | tail -4; fi ;;
    overhead-ab) # tracer cost before/after a change, alternated in one call: ab_before/ holds the earlier tree's packages (scripts/ab_tree.sh), carried untracked
        [ -d ab_before/instrument ] || { echo "no ab_before/ tree (scripts/ab_tree.sh REV)"; continue; }
        for r in $(seq ${AB_ROUNDS:-2}); do for tree in before after; do
          # Each tree runs from its own folder: `python -m instrument.writer_process` (the trace
          # writer's child) puts the working folder first on its path, so it must be the tree's.
          if [ $tree = before ]; then pp=/tmp/site:$PWD/ab_before:$PWD; dir=$PWD/ab_before; else pp=/tmp/site:$PWD; dir=$PWD; fi
          echo "--- round $r, $tree"
          o=$(cd "$OUT" && pwd); root=$PWD
          (cd "$dir" && PYTHONPATH=$pp timeout ${AB_TIMEOUT:-140} python3 bench/bench_trace_overhead.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer $root/samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --modes off,trace --rounds 1 --min-run-s ${AB_RUN_S:-10} ${AB_ARGS:-} --out "$o/overhead_ab_${tree}_$r.json" 2>&1 | tee "$o/overhead_ab_${tree}_$r.log" | grep -A3 -E "^measured directly|^end to end|^    gc on" | grep -v "^    [CPUwal]*:")
        done; done
        (cd "$OUT" && tar czf overhead_ab_logs.tgz overhead_ab_*.log && rm -f overhead_ab_*.log) ;;
    overhead-begins) # --trace-begins recorded vs derived (and graph stamps on/off) in one process: timed runs and the direct measurement alternated (BEGINS_ROUNDS)
        timeout ${BEGINS_TIMEOUT:-330} python3 bench/bench_trace_overhead.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --modes ${BEGINS_MODES:-off,trace-recorded,trace-derived,trace-derived-events} --rounds ${BEGINS_ROUNDS:-3} --direct-rounds ${BEGINS_ROUNDS:-3} --min-run-s ${BEGINS_RUN_S:-5} --micro-steps 1000 ${BEGINS_ARGS:-} --out "$OUT/overhead_begins${IL_TAG:-}.json" 2>&1 | tee "$OUT/overhead_begins${IL_TAG:-}.log" | grep -v "^    " | tail -30 ;;
    repro-digest) # several engines (REPRO_MODES; "off#2": a second engine of a mode) run the same greedy workloads round after round; per-request token differences printed
        timeout ${REPRO_TIMEOUT:-300} python3 bench/repro_digest.py --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --modes ${REPRO_MODES:-off,trace-derived,trace-recorded,off#2} --rounds ${REPRO_ROUNDS:-10} ${REPRO_ARGS:-} --out "$OUT/repro_digest${IL_TAG:-}.json" 2>&1 | tee "$OUT/repro_digest${IL_TAG:-}.log" | tail -45 ;;
    poll-ab) # the device timeline's poll policy, alternated in one call: --poll auto (the engine's) vs background (or wait, inline: POLL_POLICIES)
        mkdir -p "$OUT/poll_ab"
        for r in $(seq ${POLL_ROUNDS:-3}); do for p in ${POLL_POLICIES:-auto background}; do echo "--- round $r, --poll $p"
          timeout ${POLL_TIMEOUT:-75} python3 bench/bench_trace_overhead.py --interleaved --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --min-run-s ${POLL_RUN_S:-25} --block-steps ${IL_BLOCK_STEPS:-256} --modes off,trace --poll $p ${POLL_ARGS:-} --out "$OUT/poll_ab/il_${p}_$r.json" > "$OUT/poll_ab/il_${p}_$r.log" 2>&1
          grep -E "engine CPU|process CPU|host wall|critical host|step wall us  |throughput traced|polls due|in-wait polls|tracer threads|polls. CPU" "$OUT/poll_ab/il_${p}_$r.log"; done; done
        tar czf "$OUT/poll_ab.tgz" -C "$OUT" poll_ab && rm -rf "$OUT/poll_ab" ;;
    poll-chunk-ab) # the poller's stretch (--poll-chunk), its reads' GIL (--event-api) and the wait's poll batch (--poll-batch), alternated in one call; PCA_VARIANTS: api:chunk[:batch[:deferred]]; each run prints the tracer threads' CPU per traced step
      mkdir -p "$OUT/poll_chunk_ab"
      for r in $(seq ${PCA_ROUNDS:-2}); do for v in ${PCA_VARIANTS:-driver:16 driver:256 driver-held:256}; do IFS=: read -r api chunk batch deferred <<< "$v"; batch=${batch:-128}; deferred=${deferred:-256}; echo "--- round $r, --event-api $api --poll-chunk $chunk --poll-batch $batch --max-deferred $deferred"
        timeout ${PCA_TIMEOUT:-100} python3 bench/bench_trace_overhead.py --interleaved --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --min-run-s ${PCA_RUN_S:-45} --block-steps ${IL_BLOCK_STEPS:-64} --modes off,trace --event-api $api --poll-chunk $chunk --poll-batch $batch --max-deferred $deferred ${PCA_ARGS:-} --out "$OUT/poll_chunk_ab/il_${api}_${chunk}_${batch}_${deferred}_$r.json" > "$OUT/poll_chunk_ab/il_${api}_${chunk}_${batch}_${deferred}_$r.log" 2>&1
        grep -E "engine CPU|process CPU|host wall|step wall us  |throughput traced|tracer threads|polls. CPU|polls due|driver reads|event records" "$OUT/poll_chunk_ab/il_${api}_${chunk}_${batch}_${deferred}_$r.log"; done; done
      tar czf "$OUT/poll_chunk_ab.tgz" -C "$OUT" poll_chunk_ab && rm -rf "$OUT/poll_chunk_ab" ;;
    core-ab) # the compiled stage core against the Python one: the no-device micro bench (CORE_MICRO=0: skipped), then the interleaved traced/untraced A/B with each core (STEPSCOPE_STAGE_CORE), alternated CORE_ROUNDS times; variants: python, c (the compiled core with the polls' Python slice loop: STEPSCOPE_COMPILED_EMIT=0), c-emit (the compiled core building the polls' slices too, the default since session 20); a -quiet suffix (c-emit-quiet) runs --poll wait --flush-interval 3600: the tracer's helper threads idle through the timed run; an -aa suffix (c-emit-aa) is an A/A control, the tracer off in every block; -i inverts every pair's order (c-emit-i: a crossover with c-emit); a final -r (c-emit-r, c-emit-aa-r) draws the round's block order at random from CORE_ORDER_SEED (100) + round; CORE_ARGS=--save-samples keeps every step's sample in the JSON
      [ "${CORE_MICRO:-1}" = 1 ] && timeout 120 python3 bench/bench_stage_core.py --steps 3000 --rounds 7 --out "$OUT/stage_core_micro.json" 2>&1 | tee "$OUT/stage_core_micro.log"
      mkdir -p "$OUT/core_ab"
      for r in $(seq ${CORE_ROUNDS:-3}); do for c in ${CORE_VARIANTS:-python c}; do echo "--- round $r, stage core $c"
        core=${c%-r}; extra=""  # a variant: CORE[-quiet|-aa][-i][-r]
        [ "$core" != "$c" ] && extra="--order-seed $((${CORE_ORDER_SEED:-100} + r))"  # -r: the round's block order drawn at random (the same for the round's variants)
        [ "${core%-i}" != "$core" ] && { core=${core%-i}; extra="$extra --order-invert"; }  # -i: every pair's order inverted (a crossover with the plain variant)
        case $core in *-quiet) extra="$extra --poll wait --flush-interval 3600";; *-aa) extra="$extra --control";; esac  # -quiet: helper threads idle in the timed run; -aa: an A/A control, never traced
        core=${core%-quiet}; core=${core%-aa}; emit=0; [ "$core" = c-emit ] && emit=1
        STEPSCOPE_STAGE_CORE=${core%-emit} STEPSCOPE_COMPILED_EMIT=$emit timeout ${CORE_TIMEOUT:-95} python3 bench/bench_trace_overhead.py --interleaved --device cuda --dtype bfloat16 --model-config qwen3-0.6b --random-weights --tokenizer samples/models/pycoder-14m --num-requests 1024 --in-len 128 --out-len 128 --num-kv-blocks 16384 --max-num-seqs 256 --max-num-batched-tokens 8192 --min-run-s ${CORE_RUN_S:-20} --block-steps ${IL_BLOCK_STEPS:-64} --modes off,trace $extra ${CORE_ARGS:-} --out "$OUT/core_ab/il_${c}_$r.json" > "$OUT/core_ab/il_${c}_$r.log" 2>&1
        grep -E "stage core|engine CPU|process CPU|host wall|step wall us  |throughput traced|tracer threads|polls. CPU|polls due" "$OUT/core_ab/il_${c}_$r.log"; sed -n '/where the traced/,$p' "$OUT/core_ab/il_${c}_$r.log"; done; done
      tar czf "$OUT/core_ab.tgz" -C "$OUT" core_ab && rm -rf "$OUT/core_ab" ;;
    cold) timeout ${COLD_TIMEOUT:-300} python3 bench/bench_cold_start.py ${COLD_ARGS:-} --out "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log" | tail -12 ;;
    split) # the varlen launch's split_decodes key (docs/design.md §2.6): its GPU test, phase 3 of the tuner around the table's entry, then a mixed step with it off/on alternated step by step
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_attention_gpu.py 2>&1 | tee "$OUT/attention_gpu.log" | tail -4
      timeout ${SPLIT_TUNE_TIMEOUT:-150} python3 bench/tune_varlen_attention.py --block-m 64 --block-n 64 --warps 4 --stages 2 --small 16x128 --budget-s 100 --json "$OUT/tune_varlen_split.json" 2>&1 | tee "$OUT/tune_varlen_split.log" | tail -22
      timeout ${SPLIT_MIXED_TIMEOUT:-280} python3 bench/bench_mixed_step.py --profile --modes graph,graph+split,eager,eager+split --prompt-lens ${SPLIT_PROMPTS:-128,1984} --json "$OUT/mixed_step_split.json" 2>&1 | tee "$OUT/mixed_step_split.log" | grep -v "^  " | tail -30
      grep -A18 "one eager" "$OUT/mixed_step_split.log" | head -60 ;;
    e2e-8b) timeout 590 python3 bench/bench_e2e.py --device cuda --workloads 8b-256x128-128 ${E2E_ARGS:-} --out "$OUT/e2e_8b.json" 2>&1 | tee "$OUT/e2e_8b.log" | tail -14 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
