"""Per-sample comparison of two lm-eval runs' samples files (loglikelihoods and generations)."""
import glob, json, sys

def load(d, task):
    """The newest samples file of ``task`` under ``d`` (names carry their run's time)."""
    f = max(glob.glob(f"{d}/**/samples_{task}_*.jsonl", recursive=True))
    return [json.loads(line) for line in open(f)]

a_dir, b_dir = sys.argv[1], sys.argv[2]
diffs, same_pick, n = [], 0, 0
for x, y in zip(load(a_dir, "tl_mc"), load(b_dir, "tl_mc")):
    la = [float(r[0]) for r in x["filtered_resps"]]
    lb = [float(r[0]) for r in y["filtered_resps"]]
    diffs += [abs(p - q) for p, q in zip(la, lb)]
    same_pick += la.index(max(la)) == lb.index(max(lb)); n += 1
print(f"tl_mc: {len(diffs)} loglikelihoods, max |diff| {max(diffs):.2e}, mean {sum(diffs)/len(diffs):.2e}; "
      f"same choice on {same_pick}/{n} questions")
ga = [x["filtered_resps"] for x in load(a_dir, "tl_gen")]
gb = [y["filtered_resps"] for y in load(b_dir, "tl_gen")]
print(f"tl_gen: {sum(p == q for p, q in zip(ga, gb))}/{len(ga)} generations identical")
