# rftstream recipes. `just setup-run` creates .venv and installs what `rftstream up` needs;
# `just setup` (alias `setup-all`) adds every extra and the test tools. The other recipes
# call one of them first, so `just up` / `just test` work on a fresh clone.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv"
py := venv + "/bin/python"
# CPU wheel by default (CI and laptops); GPU users: RFTSTREAM_TORCH='torch' just setup
torch_spec := env_var_or_default("RFTSTREAM_TORCH", "torch==2.13.0")
# pytest workers of `just test` (0: the suite in this process, one case at a time)
test_workers := env_var_or_default("RFTSTREAM_TEST_WORKERS", "0")

# (the runtime and the CPU torch wheel, no extras)
# create .venv and install what `rftstream up` needs
setup-run:
    test -x {{py}} || python3 -m venv {{venv}}
    {{py}} -m pip install -qq --disable-pip-version-check '{{torch_spec}}'
    {{py}} -m pip install -qq --disable-pip-version-check -e .

# setup-run, then every extra (Data-Juicer, monitors, LoRA, ...) and the test tools
setup: setup-run
    {{py}} -m pip install -qq --disable-pip-version-check -e '.[test]'

alias setup-all := setup

# (Debian packages; as root with apt only, elsewhere those tests skip and say why)
# headless Chromium for tests/smoke/test_studio.py
browser:
    if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
    fi

# the embedded default run: private NATS, tiny model, GRPO on CPU
up *ARGS: setup-run
    {{venv}}/bin/rftstream up {{ARGS}}

# (RFTSTREAM_TEST_WORKERS=2: its files over two pytest workers, 11-12 minutes here against
# 19; not the default yet: each such run so far found a case that races with load)
# the whole test suite (units, integration against a real nats-server, smoke)
test *ARGS: setup browser
    {{venv}}/bin/pytest -q -n {{test_workers}} --dist loadfile {{ARGS}}

# ruff lint and format check
lint: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .

# Codec; the bus against a tuned raw nats-py client; MIX vs GRPO reward per step; weight
# sync, bus against files (`just bench --quick` for these four); then rftstream against
# TRL's GRPOTrainer on three workloads, five seeds (nine where generation dominates;
# about 60 minutes on 2 cores), and
# start-up from a fresh clone and warm, beside TRL's (about 5 minutes). Every
# benchmark runs; the recipe fails at the end when one missed its target or failed.
# every benchmark, each against a baseline measured in the same run
bench *ARGS: setup bench-deps
    #!/usr/bin/env bash
    set -u
    failed=()
    for b in run bus mix_vs_grpo weights; do
        {{py}} benchmarks/$b.py {{ARGS}} || failed+=("$b (exit $?)")
    done
    {{py}} benchmarks/vs_trl.py || failed+=("vs_trl (exit $?)")
    {{py}} benchmarks/startup.py || failed+=("startup (exit $?)")
    if [ ${#failed[@]} -gt 0 ]; then echo "benchmarks that missed or failed: ${failed[*]}"; exit 1; fi

# (ARGS: --steps N, --models 0.5b,tiny, --seeds N; about 15 minutes on 2 cores)
# weight sync over the bus against checkpoint files, on a 0.5B-shaped model and the tiny one
bench-weights *ARGS: setup
    {{py}} benchmarks/weights.py {{ARGS}}

# (ARGS: --workload default|longtail|genheavy, --seeds 1,2,3, --out DIR; exits 1 on a MISS)
# rftstream against TRL's GRPOTrainer only
bench-trl *ARGS: setup bench-deps
    {{py}} benchmarks/vs_trl.py {{ARGS}}

# (a fresh clone installs and runs `just up`; then warm starts against TRL's, 5 each)
# start-up: a fresh clone to the first trainer step, and a warm start, beside TRL's
bench-startup *ARGS: setup bench-deps
    {{py}} benchmarks/startup.py {{ARGS}}

# what the benchmarks need beyond the package: TRL, for benchmarks/vs_trl.py
bench-deps:
    {{py}} -m pip install -qq --disable-pip-version-check -e '.[bench]'

# the import graph: core -> plugin imports, imports inside functions, import cycles
imports:
    python3 tools/import_graph.py
