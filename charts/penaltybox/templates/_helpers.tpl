{{/* The labels every object of the release carries. */}}
{{- define "penaltybox.labels" -}}
app.kubernetes.io/name: penaltybox
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | replace "+" "_" | trunc 63 | quote }}
{{- end -}}

{{/* The agent's labels: the DaemonSet's selector, as in deploy/. */}}
{{- define "penaltybox.agentLabels" -}}
{{ include "penaltybox.labels" . }}
app.kubernetes.io/component: agent
{{- end -}}

{{/* The service account's user name, as admission policies see it. */}}
{{- define "penaltybox.agentUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:penaltybox-agent
{{- end -}}

{{- define "penaltybox.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
