#!/usr/bin/env bash
# Create (or reuse) the kind cluster `coserve-e2e`, write its kubeconfig to a file of its own and
# install the CoServePool CRD and the CRDs gateway mode uses (HTTPRoute, InferencePool). Needs Docker,
# kind and kubectl. Progress goes to stderr; stdout is one `export KUBECONFIG=...` line, so:
#
#   eval "$(e2e/kind-up.sh)" && make e2e
#   eval "$(e2e/kind-up.sh --with-operator)" && E2E_OPERATOR_IN_CLUSTER=1 make e2e
#   kind delete cluster --name coserve-e2e      # when done
#
# --with-operator also builds the control-plane image from the repository's Dockerfile, loads it
# into the cluster and installs charts/coserve-operator with helm (needs helm on PATH; `make`
# puts one in .venv/bin). Without it the e2e tests run the operator on this machine.
#
# Environment: KIND_NODE_IMAGE (kindest/node image, default: kind's own), E2E_KUBECONFIG (where the
# kubeconfig goes, default ~/.kube/kind-coserve-e2e.yaml; your ~/.kube/config is left alone).
set -euo pipefail

with_operator=0
if [[ "${1:-}" == "--with-operator" ]]; then
  with_operator=1
elif [[ -n "${1:-}" ]]; then
  echo "kind-up: unknown argument ${1} (the only option is --with-operator)" >&2
  exit 2
fi

cluster=coserve-e2e
kubeconfig="${E2E_KUBECONFIG:-${HOME}/.kube/kind-${cluster}.yaml}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

for tool in docker kind kubectl; do
  if ! command -v "${tool}" >/dev/null 2>&1; then
    echo "kind-up: ${tool} is not on PATH" >&2
    exit 1
  fi
done
if ! docker info >/dev/null 2>&1; then
  echo "kind-up: the Docker engine is not reachable (kind runs its nodes as containers)" >&2
  exit 1
fi

clusters="$(kind get clusters 2>/dev/null)"
if grep -qx "${cluster}" <<<"${clusters}"; then
  echo "kind-up: reusing kind cluster ${cluster}" >&2
else
  create_args=(--name "${cluster}" --wait 120s)
  if [[ -n "${KIND_NODE_IMAGE:-}" ]]; then
    create_args+=(--image "${KIND_NODE_IMAGE}")
  fi
  kind create cluster "${create_args[@]}" >&2
fi

mkdir -p "$(dirname "${kubeconfig}")"
kind export kubeconfig --name "${cluster}" --kubeconfig "${kubeconfig}" >&2

export KUBECONFIG="${kubeconfig}"
kubectl apply --server-side --field-manager=coserve-e2e --force-conflicts -f "${root}/crds/" >&2
kubectl wait --for condition=established crd/coservepools.coserve.dev --timeout=60s >&2
# Gateway mode's kinds, as their projects publish them (e2e/crds/README.md): what a gateway's install provides
kubectl apply --server-side --field-manager=coserve-e2e --force-conflicts -f "${root}/e2e/crds/" >&2
kubectl wait --for condition=established crd/inferencepools.inference.networking.k8s.io \
  crd/httproutes.gateway.networking.k8s.io --timeout=60s >&2

if [[ "${with_operator}" == 1 ]]; then
  export PATH="${root}/.venv/bin:${PATH}"
  if ! command -v helm >/dev/null 2>&1; then
    echo "kind-up: helm is not on PATH (run make once: it installs helm into .venv/bin)" >&2
    exit 1
  fi
  image=ghcr.io/coserve/coserve:e2e
  echo "kind-up: building ${image}" >&2
  docker build -t "${image}" "${root}" >&2
  kind load docker-image "${image}" --name "${cluster}" >&2
  helm upgrade --install coserve "${root}/charts/coserve-operator" --namespace coserve-system \
    --create-namespace --set image.tag=e2e --set image.pullPolicy=Never --wait --timeout 180s >&2
fi

echo "export KUBECONFIG=${kubeconfig}"
