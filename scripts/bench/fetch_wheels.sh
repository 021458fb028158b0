#!/usr/bin/env bash
# Fetch the wheels a GPU machine without network needs, on a machine with network (PyPI), from the repository root.
#
#   bash scripts/bench/fetch_wheels.sh                      # .whl/   titanlike's own dependencies the GPU image lacks
#   bash scripts/bench/fetch_wheels.sh --peer               # + .peer/  torchtitan 0.2.2 (the benchmark peer) and its needs
#   bash scripts/bench/fetch_wheels.sh --extra fla-core==0.6.0 peft==0.21.2   # + .extra/  anything else
#
# Assumed on the GPU machine (not fetched): torch (its CUDA build), triton, numpy, safetensors, tokenizers, tiktoken,
# sentencepiece, tensorboard, transformers, pytest. Wheels are for CPython 3.12 on x86-64 Linux by default
# (PY_VERSION=3.11 etc. to change). The three folders are git-ignored: send them with the checkout, then on the GPU
# machine, from the repository root, before each command:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl [.peer/*.whl .extra/*.whl]
#   export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
py=${PY_VERSION:-3.12}

# What titanlike imports beyond the GPU image (torchft pulls in opentelemetry for its tracing).
OWN=(torchao==0.18.0 torchdata==0.11.0 torchft==0.2.0 tomli==2.5.0
     opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
     opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
     opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-http-transport==0.66b2
     opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 importlib-metadata==10.2.0)
# torchtitan 0.2.2 and what it imports that the GPU image lacks.
PEER=(torchtitan==0.2.2 datasets==4.0.0 tyro==1.0.17 dill==0.3.8 multiprocess==0.70.16 docstring-parser==0.18.0
      typeguard==4.6.0 shtab==1.13.0)

fetch() {  # folder, requirement...: binary wheels only, no dependency resolution (every pin is listed above)
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}

peer=0
extra=()
while (($#)); do
  case $1 in
    --peer) peer=1; shift ;;
    --extra) shift; while (($#)) && [[ $1 != --* ]]; do extra+=("$1"); shift; done ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fetch_wheels.sh: unknown argument '$1' (use --peer and/or --extra NAME==VERSION ...)" >&2; exit 2 ;;
  esac
done

fetch .whl "${OWN[@]}"
((peer)) && fetch .peer "${PEER[@]}"
((${#extra[@]})) && fetch .extra "${extra[@]}"
du -sh .whl $( ((peer)) && echo .peer) $( ((${#extra[@]})) && echo .extra) | sed 's/^/fetched: /'
