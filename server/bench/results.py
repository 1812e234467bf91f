"""`--save-result`: the run's result as one JSON file, named and shaped as vLLM's benchmark
writes it (`{backend}-{rate}qps[-concurrency{n}]-{model}-{YYYYmmdd-HHMMSS}.json` in --result-dir)."""

from __future__ import annotations

import json
import math
import os
from datetime import datetime

# per-request lists, written with --save-detailed only (vLLM's split)
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "generated_texts", "errors")


def save(result: dict, ns, model: str) -> str:
    now = datetime.now()
    data = {"date": now.strftime("%Y%m%d-%H%M%S"), **result}
    if math.isinf(ns.request_rate):
        data["request_rate"] = "inf"            # JSON has no infinity
    if not ns.save_detailed:
        for key in DETAILED:
            data.pop(key, None)
    for item in ns.metadata or []:
        key, _, value = item.partition("=")
        data[key.strip()] = value.strip()
    name = ns.result_filename
    if not name:
        rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate}"
        concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
        name = f"{ns.backend}-{rate}qps{concurrency}-{os.path.basename(model.rstrip('/'))}-{data['date']}.json"
    path = os.path.join(ns.result_dir or ".", name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    return path
