#!/bin/sh
# Helm post-renderer: reads the rendered manifests on stdin and writes them with stepguard's
# approval annotations on the DaemonSet (default `cilium`, or $STEPGUARD_APPROVE_DAEMONSET):
#   approve.sh IMAGE CONFIG_CHECKSUM
# IMAGE is the cilium-agent container's image as rendered; CONFIG_CHECKSUM the pod template's
# cilium.io/cilium-configmap-checksum (`helm template ... | grep cilium-configmap-checksum`).
set -eu
if [ "$#" -ne 2 ] || [ -z "$1" ] || [ -z "$2" ]; then
  echo "stepguard-approve: want two arguments, the image and the config checksum (--post-renderer-args twice)" >&2
  exit 2
fi
ds="${STEPGUARD_APPROVE_DAEMONSET:-cilium}"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/rendered.yaml"
cat > "$dir/kustomization.yaml" <<KUSTOMIZATION
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - rendered.yaml
patches:
  - target:
      group: apps
      version: v1
      kind: DaemonSet
      name: "$ds"
    patch: |
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: "$ds"
        annotations:
          stepguard.io/approve-image: "$1"
          stepguard.io/approve-config-checksum: "$2"
KUSTOMIZATION
kubectl kustomize "$dir"
