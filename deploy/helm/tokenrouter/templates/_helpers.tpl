{{- define "tokenrouter.name" -}}
{{- .Chart.Name -}}
{{- end -}}

{{- define "tokenrouter.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tokenrouter.secretName" -}}
{{- if .Values.apiKeys.existingSecret -}}
{{- .Values.apiKeys.existingSecret -}}
{{- else -}}
{{- printf "%s-%s-keys" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
