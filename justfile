# rftstream recipes. `just setup` creates .venv and installs everything;
# the other recipes call it first, so `just up` / `just test` work on a fresh clone.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := ".venv"
py := venv + "/bin/python"
# CPU wheel by default (CI and laptops); GPU users: RFTSTREAM_TORCH='torch' just setup
torch_spec := env_var_or_default("RFTSTREAM_TORCH", "torch==2.13.0")

# create .venv and install rftstream with its test tools
setup:
    test -x {{py}} || python3 -m venv {{venv}}
    {{py}} -m pip install -qq --disable-pip-version-check '{{torch_spec}}'
    {{py}} -m pip install -qq --disable-pip-version-check -e '.[test]'

# headless Chromium for tests/smoke/test_studio.py (Debian packages; as root with apt only,
# elsewhere those tests skip and say why)
browser:
    if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
    fi

# the embedded default run: private NATS, tiny model, GRPO on CPU
up *ARGS: setup
    {{venv}}/bin/rftstream up {{ARGS}}

# the whole test suite (units, integration against a real nats-server, smoke)
test *ARGS: setup browser
    {{venv}}/bin/pytest -q {{ARGS}}

# ruff lint and format check
lint: setup
    {{venv}}/bin/ruff check .
    {{venv}}/bin/ruff format --check .

# benchmarks: print figures and ratios against a baseline measured in the same run
# (codec; the bus against raw nats-py; MIX vs GRPO reward per step; weight sync, bus against
# files; `just bench --quick`),
# then rftstream against TRL's GRPOTrainer on the same workload (about 10 minutes on CPU)
bench *ARGS: setup
    {{py}} -m pip install -qq --disable-pip-version-check -e '.[bench]'
    {{py}} benchmarks/run.py {{ARGS}}
    {{py}} benchmarks/bus.py {{ARGS}}
    {{py}} benchmarks/mix_vs_grpo.py {{ARGS}}
    {{py}} benchmarks/weights.py {{ARGS}}
    {{py}} benchmarks/vs_trl.py

# weight sync over the bus against checkpoint files, on a 0.5B-shaped model and the tiny one
# (ARGS: --steps N, --models 0.5b,tiny, --seeds N; about 15 minutes on 2 cores)
bench-weights *ARGS: setup
    {{py}} benchmarks/weights.py {{ARGS}}

# rftstream against TRL's GRPOTrainer only (ARGS: --variant default|longtail, --no-fixed, ...)
bench-trl *ARGS: setup
    {{py}} -m pip install -qq --disable-pip-version-check -e '.[bench]'
    {{py}} benchmarks/vs_trl.py {{ARGS}}

# the import graph: core -> plugin imports, imports inside functions, import cycles
imports:
    python3 tools/import_graph.py
