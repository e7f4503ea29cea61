{{/* Names are fixed where the operator's code and its generated RBAC name them (one operator per cluster). */}}
{{- define "flotilla.operatorName" -}}flotilla-operator{{- end }}
{{- define "flotilla.webhookName" -}}flotilla-webhook{{- end }}
{{- define "flotilla.webhookSecret" -}}
{{- if eq .Values.webhook.certs "existingSecret" }}{{ .Values.webhook.existingSecret }}{{ else }}flotilla-webhook-tls{{ end }}
{{- end }}

{{- define "flotilla.labels" -}}
app.kubernetes.io/name: flotilla-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: flotilla
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "flotilla.selectorLabels" -}}
app.kubernetes.io/name: flotilla-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "flotilla.operatorImage" -}}
{{ .Values.operator.image.repository }}:{{ .Values.operator.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "flotilla.engineImage" -}}
{{ .Values.operator.engineImage.repository }}:{{ .Values.operator.engineImage.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The DNS names the API server may dial: the webhook Service's, and the host of webhook.url. */}}
{{- define "flotilla.webhookDNSNames" -}}
{{- $svc := include "flotilla.webhookName" . -}}
{{- $names := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- with .Values.webhook.url }}{{ $host := (urlParse .).host | splitList ":" | first }}{{ if not (regexMatch "^[0-9.]+$" $host) }}{{ $names = append $names $host }}{{ end }}{{ end -}}
{{- toJson $names -}}
{{- end }}

{{- define "flotilla.webhookIPs" -}}
{{- $ips := list -}}
{{- with .Values.webhook.url }}{{ $host := (urlParse .).host | splitList ":" | first }}{{ if regexMatch "^[0-9.]+$" $host }}{{ $ips = append $ips $host }}{{ end }}{{ end -}}
{{- toJson $ips -}}
{{- end }}

{{- define "flotilla.gatewayName" -}}flotilla-gateway{{- end }}

{{- define "flotilla.gatewayImage" -}}
{{ .Values.gateway.image.repository }}:{{ .Values.gateway.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "flotilla.gatewaySelectorLabels" -}}
app.kubernetes.io/name: flotilla-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The Secret with the installation's master token (key `token`): the operator derives each namespace's
engine token from it, the gateway the same token to present. */}}
{{- define "flotilla.engineTokenSecret" -}}
{{- .Values.engineToken.existingSecret | default "flotilla-engine-token-master" -}}
{{- end }}
