#!/usr/bin/env bash
# jaxserve alone: async scheduling on vs off, interleaved, c1 and c16 sampled (workload A shape)
J=/work/main/.venv/bin/jaxserve
for rep in 1 2; do for mode in async sync; do
  flag=""; [ $mode = sync ] && flag="--no-async-scheduling"
  $J serve --port 8205 --host 127.0.0.1 --max-num-seqs 64 --max-model-len 1024 --no-enable-prefix-caching $flag > srv_$mode$rep.log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:8205/ready >/dev/null; do sleep 1; done
  for c in 1 16; do
    n=$([ $c = 1 ] && echo 4 || echo 16)
    $J bench serve --base-url http://127.0.0.1:8205 --num-prompts $n --random-input-len 256 --random-output-len 128 \
      --random-range-ratio 0.75 --max-concurrency $c --ignore-eos --temperature 0.7 --top-p 0.95 --disable-tqdm --server-pid $pid \
      --save-result --result-filename r_${mode}_c${c}_$rep.json > b_${mode}_c${c}_$rep.log 2>&1
    python3 -c "import json;d=json.load(open('r_${mode}_c${c}_$rep.json'));print('$mode c$c rep$rep', {k:round(v,2) for k,v in d.items() if isinstance(v,(int,float)) and any(s in k for s in ('output_throughput','median_tpot','median_ttft','cpu_ms_per'))})"
  done
  kill $pid; wait $pid 2>/dev/null
done; done
