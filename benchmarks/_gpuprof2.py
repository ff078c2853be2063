import sys, time, statistics
sys.path.insert(0, "benchmarks")
import mlx.core as mx
from decode_variants import make_model, prompts_for, Decode
from mlx_watchdog.introspect import find_arrays
from mlx_watchdog.graph import account, is_evaluated, export_dot
m = make_model("qwen3_next", 48, 2048, 32000, "bfloat16", 32)
d = Decode(m, "unwatched", "batched", prompts_for(4, 64, 32000), 2000)
def arrays():
    return [a for _, a in find_arrays(d.live_cache())]
d.advance(20); mx.synchronize()
res = {k: [] for k in ("walk_inflight", "walk_synced", "dot_inflight", "find", "iseval", "fix1_inflight", "fix16_inflight", "fix16_synced", "step")}
for rep in range(12):
    # chain 16 deep: let 16 steps accumulate, then fix in flight
    t = time.perf_counter(); d.advance(16); res["step"].append((time.perf_counter() - t) / 16)
    t = time.perf_counter(); arr = arrays(); res["find"].append(time.perf_counter() - t)
    t = time.perf_counter(); r = account(arr); res["walk_inflight"].append(time.perf_counter() - t)
    t = time.perf_counter(); export_dot(arr); res["dot_inflight"].append(time.perf_counter() - t)
    t = time.perf_counter(); pend = [a for a in arr if not is_evaluated(a)]; res["iseval"].append(time.perf_counter() - t)
    t = time.perf_counter(); mx.async_eval(pend); res["fix16_inflight"].append(time.perf_counter() - t)
    d.advance(16); arr = arrays(); pend = [a for a in arr if not is_evaluated(a)]; mx.synchronize()
    t = time.perf_counter(); r2 = account(arr); res["walk_synced"].append(time.perf_counter() - t)
    t = time.perf_counter(); mx.async_eval(pend); res["fix16_synced"].append(time.perf_counter() - t)
    mx.synchronize()
    d.advance(1); arr = arrays(); pend = [a for a in arr if not is_evaluated(a)]
    t = time.perf_counter(); mx.async_eval(pend); res["fix1_inflight"].append(time.perf_counter() - t)
print(f"arrays {len(arr)} pending {len(pend)} retained {r.retained_buffers} nodes {r.pending_nodes} dot bytes {r.dot_bytes}")
for k, v in res.items():
    print(f"{k:15s} median {statistics.median(v)*1e3:8.3f} ms  min {min(v)*1e3:8.3f} max {max(v)*1e3:8.3f}", flush=True)
d.finish()
