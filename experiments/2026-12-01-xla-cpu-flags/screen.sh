#!/bin/bash
# usage: screen.sh ROUND ["config ..."]  (run from this folder; the dots.py timings per XLA_FLAGS setting;
# XLA_FLAGS here is set whole, so jaxserve's default does not apply: dots.py does not import jaxserve)
# quick screen: dots.py under each config, round $1
R=${1:-1}; mkdir -p ${OUT:-results/dots}
declare -A C
C[default]=""
C[eigen]="--xla_cpu_experimental_ynn_fusion_type="
C[xnn_dot]="--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot"
C[onednn]="--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true"
C[onednn_fus]="--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_onednn_fusion_type=dot"
C[ynn_more]="--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise"
C[fastmath]="--xla_cpu_enable_fast_math=true"
C[vec512]="--xla_cpu_prefer_vector_width=512"
C[no_mt_eigen]="--xla_cpu_multi_thread_eigen=false"
for k in ${2:-default eigen xnn_dot onednn onednn_fus ynn_more fastmath vec512 no_mt_eigen}; do
  echo "== $k: ${C[$k]}  $(uptime | sed 's/.*load/load/')"
  XLA_FLAGS="${C[$k]}" nice -n 19 /work/main/.venv/bin/python dots.py ${OUT:-results/dots}/${k}_r$R.json 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -16
done
