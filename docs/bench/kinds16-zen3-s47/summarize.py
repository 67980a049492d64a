import json, statistics as st, collections, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
by=collections.defaultdict(list)
for r in rows: by[r['method']].append(r)
cats=sorted({r['category'] for r in rows})
print("method | " + " | ".join(cats+['all']) + "  (median / total tok/s)")
for m,rs0 in by.items():
    line=[m]
    for c in cats+['all']:
        rs=[r for r in rs0 if c=='all' or r['category']==c]
        tok=sum(r['num_tokens'] for r in rs); sec=sum(r['seconds'] for r in rs)
        line.append(f"{st.median([r['tokens_per_second'] for r in rs]):.2f} / {tok/sec:.2f}")
    print(" | ".join(line))
