{{/*
Names are fixed, as the kustomize base has them: the stepper finds the agents by
`app.kubernetes.io/name=stepguard` and reads Secret `stepguard-token`, and the agents listen
on port 9969 of every node's host network, so a cluster runs one release.
*/}}

{{/* The labels every object carries: the kustomize base's, then Helm's own. */}}
{{- define "stepguard.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: stepguard
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The agent's objects. */}}
{{- define "stepguard.agentLabels" -}}
{{ include "stepguard.labels" (dict "name" "stepguard" "root" .) }}
{{- end -}}

{{/* The stepper's objects. */}}
{{- define "stepguard.rolloutLabels" -}}
{{ include "stepguard.labels" (dict "name" "stepguard-rollout" "root" .) }}
{{- end -}}

{{/* The image of the agent and the stepper; the tag defaults to appVersion. */}}
{{- define "stepguard.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
