source .cute/use.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 DUALATTN_PROGRESS=0
W=/tmp/w; rm -rf $W; mkdir -p $W
for k in 0 1 2 3 4 5 6 7 8 9; do timeout 200 python3 tests/test_fast_sm90.py --worker $W/sm90-$k.jsonl "sel:$k:10:." > $W/sm90-$k.log 2>&1 & done; wait
python3 tests/test_fast_sm90.py --summary $W/sm90-*.jsonl | tee $OUT/worker_final.txt | tail -25
