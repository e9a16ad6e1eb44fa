python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH
source .cute/use.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 DUALATTN_PROGRESS=0
python3 -c "import flash_attn.cute; print('fa4 ok')"
timeout 560 python3 -m dualattn.bench --impls fast-sm90 --peers fa4,cudnn,fa2 --kind fwd --group dense,gqa --seqlen 1k,2k,4k,8k,16k --reps 10 --graph --json $OUT/bench-sm90.json 2>&1 | tee $OUT/bench-sm90.txt | grep -v "^#" | cut -c1-130
