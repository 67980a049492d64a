"""Max /health latency while one 2 MB chat prompt is tokenized by the server (before: the one-text
encode, which holds the GIL; after: the batch encode for long texts)."""
import json, subprocess, sys, threading, time, random
import httpx

mode, port = sys.argv[1], int(sys.argv[2])
pre = "import tokenleap.text.tokenizer as t; t._DETACHED_CHARS = 10**12; " if mode == "before" else ""
code = pre + ("import sys; from tokenleap.cli.main import main; sys.exit(main(['serve', '--model', "
              f"'smollm2-135m-instruct', '--spec', 'none', '--port', '{port}']))")
proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.5)
rng = random.Random(0)
words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", "\n", "x = 1", "é", "中文"]
text = " ".join(rng.choice(words) for _ in range(400_000))[:2_000_000]
results = {}
for attempt in range(3):
    lat, done = [], threading.Event()

    def poll():
        while not done.is_set():
            t0 = time.perf_counter()
            httpx.get(url + "/health", timeout=60)
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
    th = threading.Thread(target=poll)
    th.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                      "max_tokens": 4}, timeout=300)
    took = time.perf_counter() - t0
    done.set(); th.join()
    results[attempt] = {"status": r.status_code, "request_s": round(took, 2), "health_max_s": round(max(lat), 3),
                        "health_median_s": round(sorted(lat)[len(lat) // 2], 4), "polls": len(lat)}
proc.terminate(); proc.wait(30)
print(mode, json.dumps(results))
