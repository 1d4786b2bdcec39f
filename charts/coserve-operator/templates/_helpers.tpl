{{/* Names and labels shared by every template. */}}
{{- define "coserve-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "coserve-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "coserve-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "coserve-operator.selectorLabels" -}}
app.kubernetes.io/name: coserve-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "coserve-operator.labels" -}}
{{ include "coserve-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's permissions: exactly the verbs and resources it uses. */}}
{{- define "coserve-operator.namespacedRules" -}}
- apiGroups: ["coserve.dev"]
  resources: ["coservepools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["coserve.dev"]
  resources: ["coservepools/status"]
  verbs: ["get", "patch"]
# delete (deployments, services, networkpolicies): gateway mode's endpoint picker and the policy admitting the
# gateway's proxies go when a pool turns gateway mode off (only the pool's own, named by uid)
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# each pool's router token (a Secret it creates once) and the NetworkPolicy in front of its engines;
# RBAC cannot narrow list/watch to the operator's own Secrets, so the operator's watch selects them by label
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# gateway mode: each pool's InferencePool (Gateway API Inference Extension) and example HTTPRoute (Gateway API);
# granted whether or not their CRDs are installed (the operator reports a missing one on the pool)
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# each pool's router identity: a ServiceAccount, and a Role (with its binding) on the Leases that make one
# replica run each offline batch; RBAC lets the operator grant only what it holds, hence the leases rule
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "patch"]
# each pool's disruption budgets; delete: a budget the user turns off goes (only the pool's own, by uid)
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# a pool's model cache claim: created, its storage request grown; never deleted (it goes with the pool)
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch"]
# decoder pods get a pod-deletion-cost annotation before a scale-down (listed by the decoder selector)
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "patch"]
# a repeated Event is counted on one object (get, patch) instead of posted anew
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "get", "patch"]
{{- end -}}
