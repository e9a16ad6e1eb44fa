python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH
source .cute/use.sh || exit 1
export PYTHONUNBUFFERED=1 DUALATTN_PROGRESS=0
timeout 400 python3 -m dualattn.bench --impls fast-sm90 --peers fa4,cudnn --kind fwd --group dense --hdim 256 --seqlen 1k,2k,4k,8k,16k --reps 10 --graph --json $OUT/bench-hd256.json 2>&1 | grep "fast-sm90" | cut -c1-130
