{{/* Names and labels. */}}
{{- define "llc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "llc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "llc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The proxy nodes' pods. */}}
{{- define "llc.nodeSelectorLabels" -}}
{{ include "llc.selectorLabels" . }}
app.kubernetes.io/component: proxy-node
{{- end }}

{{- define "llc.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding the control-plane token. */}}
{{- define "llc.tokenSecret" -}}
{{- default (printf "%s-token" (include "llc.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* Whether the nodes use the bundled Redis. */}}
{{- define "llc.usesBundledRedis" -}}
{{- if and .Values.bundledRedis.enabled (eq .Values.redis.mode "single") (not .Values.redis.host) (not .Values.redis.urlSecret.name) }}true{{ end }}
{{- end }}

{{/* The bundled Redis's password Secret: redis.existingSecret, or one the chart generates. */}}
{{- define "llc.bundledRedisSecret" -}}
{{- default (printf "%s-redis" (include "llc.fullname" .)) .Values.redis.existingSecret }}
{{- end }}

{{/* The Secret holding the password the nodes send to Redis, or "" when there is none. */}}
{{- define "llc.redisPasswordSecret" -}}
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecret }}
{{- else if include "llc.usesBundledRedis" . }}
{{- include "llc.bundledRedisSecret" . }}
{{- end }}
{{- end }}

{{/* The Redis URL, the password as $(REDIS_PASSWORD) (Kubernetes expands it from the env). */}}
{{- define "llc.redisUrl" -}}
{{- $r := .Values.redis }}
{{- $user := $r.username }}
{{- $auth := "" }}
{{- if include "llc.redisPasswordSecret" . }}
{{- $auth = printf "%s:$(REDIS_PASSWORD)@" $user }}
{{- else if $user }}
{{- $auth = printf "%s@" $user }}
{{- end }}
{{- if eq $r.mode "single" }}
{{- $host := $r.host }}
{{- if include "llc.usesBundledRedis" . }}
{{- $host = printf "%s-redis" (include "llc.fullname" .) }}
{{- end }}
{{- if not $host }}
{{- fail "redis.host is required in single mode (or set bundledRedis.enabled=true to try the chart out)" }}
{{- end }}
{{- printf "%s://%s%s:%v/%v" (ternary "rediss" "redis" (eq (toString $r.tls) "true")) $auth $host $r.port $r.db }}
{{- else if eq $r.mode "sentinel" }}
{{- if not $r.sentinel.hosts }}
{{- fail "redis.sentinel.hosts is required in sentinel mode" }}
{{- end }}
{{- printf "redis+sentinel://%s%s/%s/%v" $auth (join "," $r.sentinel.hosts) $r.sentinel.masterName $r.db }}
{{- else if eq $r.mode "cluster" }}
{{- if not $r.cluster.hosts }}
{{- fail "redis.cluster.hosts is required in cluster mode" }}
{{- end }}
{{- printf "redis+cluster://%s%s" $auth (join "," $r.cluster.hosts) }}
{{- else }}
{{- fail (printf "redis.mode must be single, sentinel or cluster, got %q" $r.mode) }}
{{- end }}
{{- end }}

{{/* Prometheus label matchers of this release's scrape targets. */}}
{{- define "llc.promSelector" -}}
namespace="{{ .Release.Namespace }}",service="{{ include "llc.fullname" . }}-control"
{{- end }}
