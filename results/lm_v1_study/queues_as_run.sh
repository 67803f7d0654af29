#!/bin/bash
# The study's run queues, in the order they ran (several queue scripts, concatenated; each started with
# its worker letter and the PID of the queue to wait for). Recorded paths were rewritten when the tools
# moved: the checkout is now the git top level, and the study's wrappers, then in a scratch folder, are
# now `scripts/lm_v1_study.py ablate|dynamics`. Each run writes results/lm_v1_study/<name>.json and .log.
# usage: queue.sh A|B   -- runs one worker's list of ablations sequentially, 1 thread each
cd "$(git rev-parse --show-toplevel)"
R=results/lm_v1_study
PY=.venv/bin/python
S="scripts/compare_lm_variants.py --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
if [ "$W" = A ]; then
  run base_lr3e-3        $PY $S --variants standard diff --seeds 0 1 2
  run dyn_standard_s1   $PY scripts/lm_v1_study.py dynamics standard 1 $R/dyn_standard_s1.json
  run dyn_diff_s1       $PY scripts/lm_v1_study.py dynamics diff 1 $R/dyn_diff_s1.json
  run heads8_lr3e-3      $PY $S --variants standard diff --heads 8 --seeds 0 1 2
  run lr1e-3             $PY $S --variants standard diff --lr 1e-3 --seeds 0 1
  run v1_vinit5          $PY $S --variants diff --v1-v-init-scale 5 --seeds 0 1 2
else
  run v1_out0.1          $PY $S --variants diff --v1-out-init-scale 0.1 --seeds 0 1 2
  run v1_no_subnorm      $PY scripts/lm_v1_study.py ablate --no-subnorm --threads 1 --variants diff --seeds 0 1 2
  run v1_lamlr0.1        $PY $S --variants diff --lambda-lr-mult 0.1 --seeds 0 1 2
  run v1_lam_constant    $PY $S --variants diff --lambda-init constant --seeds 0 1 2
  run lr6e-4             $PY $S --variants standard diff --lr 6e-4 --seeds 0 1
  run dyn_diff_out0.1_s1 $PY scripts/lm_v1_study.py dynamics diff 1 $R/dyn_diff_out0.1_s1.json --v1-out-init-scale 0.1
fi
echo "=== $(date -u +%T) worker $W done" >> $R/queue_$W.log
#!/bin/bash
# wave 2: usage queue2.sh C|D PID_TO_WAIT_FOR
cd "$(git rev-parse --show-toplevel)"
R=results/lm_v1_study
PY=.venv/bin/python
S="scripts/compare_lm_variants.py --threads 1"
AB="scripts/lm_v1_study.py ablate --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
while kill -0 $2 2>/dev/null; do sleep 5; done
if [ "$W" = C ]; then
  run dyn_standard_s1    $PY scripts/lm_v1_study.py dynamics standard 1 $R/dyn_standard_s1.json
  run std_subnorm        $PY $AB --std-subnorm --variants standard --seeds 0 1 2
  run v1_no_subnorm_lr1e-3 $PY $AB --no-subnorm --variants diff --lr 1e-3 --seeds 0 1
else
  run dyn_diff_s1        $PY scripts/lm_v1_study.py dynamics diff 1 $R/dyn_diff_s1.json
  run v1_subnorm_eps1e-2 $PY $AB --subnorm-eps 1e-2 --variants diff --seeds 0 1 2
fi
echo "=== $(date -u +%T) worker $W done" >> $R/queue_$W.log
#!/bin/bash
# wave 3: usage queue3.sh E|F PID_TO_WAIT_FOR
cd "$(git rev-parse --show-toplevel)"
R=results/lm_v1_study
PY=.venv/bin/python
S="scripts/compare_lm_variants.py --threads 1"
AB="scripts/lm_v1_study.py ablate --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
while kill -0 $2 2>/dev/null; do sleep 5; done
if [ "$W" = E ]; then
  run v1_lamconst_epidepth  $PY $AB --lambda-init constant --epilogue-scale depth --variants diff --seeds 0 1 2
  run v1_lam_constant_lr1e-3 $PY $S --lambda-init constant --variants diff --lr 1e-3 --seeds 0 1
else
  run v1_lamdepth_epi0.2    $PY $AB --epilogue-scale 0.2 --variants diff --seeds 0 1 2
  run std_subnorm_epi0.2    $PY $AB --std-subnorm --epilogue-scale 0.2 --variants standard --seeds 0 1 2
fi
echo "=== $(date -u +%T) worker $W done" >> $R/queue_$W.log
#!/bin/bash
# wave 4: usage queue4.sh G|H PID_TO_WAIT_FOR
cd "$(git rev-parse --show-toplevel)"
R=results/lm_v1_study
PY=.venv/bin/python
S="scripts/compare_lm_variants.py --threads 1"
AB="scripts/lm_v1_study.py ablate --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
while kill -0 $2 2>/dev/null; do sleep 5; done
if [ "$W" = G ]; then
  run long1000_base         $PY $S --steps 1000 --warmup 100 --variants standard diff --seeds 0 1
else
  run long1000_v1_lam_constant $PY $S --steps 1000 --warmup 100 --lambda-init constant --variants diff --seeds 0 1
  run long1000_v1_no_subnorm   $PY $AB --no-subnorm --steps 1000 --warmup 100 --variants diff --seeds 0 1
fi
echo "=== $(date -u +%T) worker $W done" >> $R/queue_$W.log
#!/bin/bash
cd "$(git rev-parse --show-toplevel)"; R=results/lm_v1_study; W=I
while kill -0 $1 2>/dev/null; do sleep 5; done
echo "=== $(date -u +%T) start dyn_diff_lamconst_s1" >> $R/queue_$W.log
.venv/bin/python scripts/lm_v1_study.py dynamics diff 1 $R/dyn_diff_lamconst_s1.json --lambda-init constant > $R/dyn_diff_lamconst_s1.log 2>&1
echo "=== $(date -u +%T) end rc=$?" >> $R/queue_$W.log
#!/bin/bash
# wave 6: usage queue6.sh J|K PID_TO_WAIT_FOR
cd "$(git rev-parse --show-toplevel)"
R=results/lm_v1_study
PY=.venv/bin/python
S="scripts/compare_lm_variants.py --threads 1"
AB="scripts/lm_v1_study.py ablate --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
while kill -0 $2 2>/dev/null; do sleep 5; done
if [ "$W" = J ]; then
  run v1_lamdepth_epi0.1    $PY $AB --epilogue-scale 0.1 --variants diff --seeds 0 1 2
  run v1_lamdepth_epi0.2_lr1e-3 $PY $AB --epilogue-scale 0.2 --lr 1e-3 --variants diff --seeds 0 1
else
  run v1_lamdepth_epi0.4    $PY $AB --epilogue-scale 0.4 --variants diff --seeds 0 1 2
  run v1_no_subnorm_heads8  $PY $AB --no-subnorm --heads 8 --variants diff --seeds 0 1
fi
echo "=== $(date -u +%T) worker $W done" >> $R/queue_$W.log
#!/bin/bash
cd "$(git rev-parse --show-toplevel)"; R=results/lm_v1_study; W=L
while kill -0 $1 2>/dev/null; do sleep 5; done
for v in standard diff; do
echo "=== $(date -u +%T) start dyn2_${v}_s1" >> $R/queue_$W.log
.venv/bin/python scripts/lm_v1_study.py dynamics $v 1 $R/dyn_${v}_s1.json > $R/dyn_${v}_s1.log 2>&1
echo "=== $(date -u +%T) end rc=$?" >> $R/queue_$W.log
done
echo "=== $(date -u +%T) start dyn2_nosub" >> $R/queue_$W.log
echo "=== $(date -u +%T) worker L done" >> $R/queue_$W.log
#!/bin/bash
cd "$(git rev-parse --show-toplevel)"; R=results/lm_v1_study; PY=.venv/bin/python
S="scripts/compare_lm_variants.py --threads 1"; AB="scripts/lm_v1_study.py ablate --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
while kill -0 $2 2>/dev/null; do sleep 5; done
if [ "$W" = M ]; then
  run long1000_v1_epi0.2 $PY $AB --epilogue-scale 0.2 --steps 1000 --warmup 100 --variants diff --seeds 0 1
else
  run long1000_v2 $PY $S --steps 1000 --warmup 100 --variants diff_v2 --seeds 0 1
fi
echo "=== $(date -u +%T) worker $W done" >> $R/queue_$W.log
#!/bin/bash
cd "$(git rev-parse --show-toplevel)"; R=results/lm_v1_study; PY=.venv/bin/python
AB="scripts/lm_v1_study.py ablate --threads 1"
run() { name=$1; shift; echo "=== $(date -u +%T) start $name: $*" >> $R/queue_$W.log
        "$@" --json $R/$name.json > $R/$name.log 2>&1; echo "=== $(date -u +%T) end $name rc=$?" >> $R/queue_$W.log; }
W=$1
while pgrep -f "queue8.sh $W" >/dev/null; do sleep 5; done
if [ "$W" = M ]; then
  run v1_lamdepth_epi0.1_lr1e-3 $PY $AB --epilogue-scale 0.1 --lr 1e-3 --variants diff --seeds 0 1
else
  run v1_lamdepth_epi0.05 $PY $AB --epilogue-scale 0.05 --variants diff --seeds 0 1 2
fi
echo "=== $(date -u +%T) worker ${W}2 done" >> $R/queue_$W.log
