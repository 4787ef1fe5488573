"""Where does a gated zero-kernel launch block? Dumps the host stack after 8 s."""
import faulthandler, sys, time
faulthandler.dump_traceback_later(8, exit=False)
import torch
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache
from zeroer.registry import make_zeroer
from zeroer.runtime import make_runtime
kernel = sys.argv[1] if len(sys.argv) > 1 else "triton"
rt = make_runtime("cuda", mode="controlled")
rt.watchdog.timeout_s = 20 if hasattr(rt, "watchdog") else None
cache = build_cache(geometry("tiny"), device=rt.device)
z = make_zeroer("single_buffer", cache, rt, kernel=kernel)
t = time.time()
with rt.ungated():
    z.zero_block_ids([0])
rt.synchronize()
print("warm-up ok", round(time.time() - t, 2), flush=True)
t = time.time()
z.zero_block_ids([1]); print("call 1 enqueued", round(time.time() - t, 2), flush=True)
z.zero_block_ids([2]); print("call 2 enqueued", round(time.time() - t, 2), flush=True)
rt.synchronize()
print("kernel", kernel, "blocks zeroed:", [b for b in (1, 2) if bool((cache.block_words(b)[0].cpu() == 0).all())], "hazards", len(rt.hazards), flush=True)
faulthandler.cancel_dump_traceback_later()
rt.close()
