#!/usr/bin/env bash
# The GPU run behind docs/benchmarks.md's GPU tables: ce-bench on one NVIDIA GPU, every step under its own
# time limit so that one slow step cannot cost the others, each step's JSON and log written to OUT_DIR.
#
#   benchmarks/gpu.sh WHEEL_DIR OUT_DIR [PEER_SITE]
#
# WHEEL_DIR holds this workspace's wheels (`uv build --all-packages -o dist`); they are installed with no
# dependencies next to the machine's own jax[cuda]. PEER_SITE, if given, is a folder of importable
# packages put on the path too (tokamax and its dependencies, to compare against: the docs' run copied
# tokamax, einshape, immutabledict, pydantic(_core), annotated_types, typing_inspection, qwix and
# tensorboardX from `uv sync`'s environment, with a stand-in for xprof, which tokamax imports only
# for its own profiler). QUICK=1 runs the
# same steps at toy sizes (to try the script on a CPU first); PY names the interpreter (python3); STEPS
# names the steps to run (default: "heads rl oracle tests tokens"; "forward" times the `xla` forward
# alone under larger statistics budgets, benchmarks/gpu_xla_tiles.py --forward; "models" times reference
# and xla at every model head of `--shapes models`, both objectives).
set -u
wheels=${1:?WHEEL_DIR}
out=${2:?OUT_DIR}
peers=${3:-}
py=${PY:-python3}
mkdir -p "$out"
site=$(mktemp -d)
"$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH="$site${peers:+:$peers}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

bench() {  # bench NAME SECONDS ARGS...: one ce-bench run, its records to NAME.json, its table to the log
  local name=$1 limit=$2
  shift 2
  echo "== $name: ce-bench $*" | tee -a "$out/log.txt"
  local start=$SECONDS
  timeout "$limit" "$py" -c 'import sys; from ce_bench.cli import main; sys.exit(main(sys.argv[1:]))' \
    "$@" --json "$out/$name.json" --format markdown --no-progress --no-files >"$out/$name.md" 2>>"$out/log.txt"
  echo "== $name: exit $? after $((SECONDS - start)) s" | tee -a "$out/log.txt"
  tee -a "$out/log.txt" <"$out/$name.md"
  rm "$out/$name.md"
}

nvidia-smi -L 2>/dev/null | tee -a "$out/log.txt"
"$py" -c 'import jax, numpy; print("jax", jax.__version__, "numpy", numpy.__version__, jax.devices())' \
  2>&1 | tee -a "$out/log.txt"
backends=reference,xla
if "$py" -c 'import tokamax' 2>>"$out/log.txt"; then
  backends=$backends,tokamax:xla,tokamax:chunked_xla
else
  echo "tokamax does not import here: left out" | tee -a "$out/log.txt"
fi

if [ "${QUICK:-0}" = 1 ]; then
  big=tiny rl=tiny check=tiny tokens=(--tokens 512) quick=(--quick) models="tiny 64x96x1000"
else
  big=llama3-8b,gemma3 rl=rl-qwen2.5-1.5b check=small tokens=(--tokens 32768) quick=() models=models@4k
fi
steps=" ${STEPS:-heads rl oracle tests tokens} "
want() { [[ $steps == *" $1 "* ]]; }
# The head-to-head at the presets' full N (bf16), then the RL objective, then float32/bf16 against the
# float64 oracle at a size it can hold, the backends' tests, and the Llama-3 head at 32768 tokens.
want heads && bench heads 120 --backends "$backends" --shapes "$big" --dtype bfloat16 --repeats 10 --memory-shapes none
want rl && bench rl 40 --backends "$backends" --shapes "$rl" --dtype bfloat16 --objective rl --repeats 10 \
  --memory-shapes none
want oracle && bench oracle 40 --backends "$backends" --shapes "$check" --dtype float32,bfloat16 --repeats 5 \
  --memory-shapes none
# The parity tests hold float32 to 1e-4 against the oracle: on GPU JAX's default float32 matmul
# precision is TF32 (the reference itself misses by 3e-4 there), so they run at "highest".
if want tests; then
  echo "== tests" | tee -a "$out/log.txt"
  JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 "$py" -m pytest \
    -p no:cacheprovider -q -x -o addopts="--import-mode=importlib -ra" -k "not pallas" tests/test_parity.py \
    tests/test_log_probs.py >"$out/tests.txt" 2>&1
  echo "== tests: exit $?" | tee -a "$out/log.txt"
  tail -5 "$out/tests.txt"
fi
if want forward; then
  echo "== forward" | tee -a "$out/log.txt"
  timeout 200 "$py" benchmarks/gpu_xla_tiles.py --forward --repeats 10 "${quick[@]}" \
    >"$out/forward.md" 2>>"$out/log.txt"
  echo "== forward: exit $?" | tee -a "$out/log.txt"
  tee -a "$out/log.txt" <"$out/forward.md"
fi
# The model heads of issue 25's matrix (Llama-3, Qwen2.5, Qwen3, Gemma-2), the plain loss and the RL
# objective, at MODELS (default: 4096 tokens; "models@4k models@16k" for both counts). On an H200 one
# 4096-token head takes about 20 s for reference, xla and the floor at 3 repeats (compiles included), so
# the eight heads take about 3 minutes per objective; 16384 tokens take longer: give them their own lease.
if want models; then
  for objective in mean rl; do
    for half in ${MODELS:-$models}; do
      bench "models-$objective-${half#models@}" 300 --backends reference,xla --shapes "$half" --dtype bfloat16 \
        --objective "$objective" --repeats 3 --memory-shapes none
    done
  done
fi
want tokens && bench tokens 200 --backends reference,xla${backends#reference,xla} --shapes "${big%%,*}" "${tokens[@]}" \
  --dtype bfloat16 --repeats 5 --memory-shapes none
