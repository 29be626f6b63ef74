{{/* Names, labels, images, secrets and flags shared by every template. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix of every object name; component names add up to 10 characters. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pdserve
{{ include "pdserve.releaseLabels" . }}
{{- end -}}

{{/* What every pod of this release carries: the NetworkPolicies trust these. */}}
{{- define "pdserve.releaseLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* (dict "root" $ "component" "decode") */}}
{{- define "pdserve.selectorLabels" -}}
{{ include "pdserve.releaseLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* (dict "root" $ "pool" .Values.decode): repository:tag of a pool's image. */}}
{{- /* repository:tag[-variant][@digest]. A digest names one image: a pool's own
image.digest, else the top-level one for a pool of the top-level variant. */ -}}
{{- define "pdserve.image" -}}
{{- $own := .pool.image | default dict -}}
{{- $image := mergeOverwrite (deepCopy .root.Values.image) $own -}}
{{- $tag := $image.tag | default .root.Chart.AppVersion | toString -}}
{{- if $image.variant -}}{{- $tag = printf "%s-%s" $tag $image.variant -}}{{- end -}}
{{- $digest := $own.digest | default (ternary .root.Values.image.digest "" (eq ($image.variant | default "") (.root.Values.image.variant | default ""))) -}}
{{- printf "%s:%s" $image.repository $tag -}}{{- with $digest }}@{{ . }}{{- end -}}
{{- end -}}

{{- define "pdserve.pullPolicy" -}}
{{- (mergeOverwrite (deepCopy .root.Values.image) (.pool.image | default dict)).pullPolicy -}}
{{- end -}}

{{/* The CPU engine image: prepare-model needs torch and transformers. */}}
{{- define "pdserve.engineImage" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- with .Values.image.digest }}@{{ . }}{{- end -}}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- include "pdserve.fullname" . -}}
{{- end -}}

{{- define "pdserve.builtinRedis" -}}
{{- if and (not .Values.redis.url) (not .Values.redis.existingSecret) -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.redisService" -}}
{{- include "pdserve.fullname" . -}}-redis
{{- end -}}

{{/* The control plane's URL, the internal token and the API key, as container env. */}}
{{- define "pdserve.redisEnv" -}}
- name: PDSERVE_REDIS_URL
{{- if .Values.redis.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" . }}
      key: redis-url
{{- end }}
- name: PDSERVE_REDIS_PREFIX
  value: {{ .Values.redis.prefix | quote }}
{{- end -}}

{{/* The internal token as a file of its Secret, mounted: read again when the Secret
changes, so it rotates without a restart (docs/security.md). */}}
{{- define "pdserve.tokenEnv" -}}
{{- if .Values.internalToken.enabled -}}
- name: PDSERVE_INTERNAL_TOKEN_FILE
  value: /etc/pdserve/internal-token/token
- name: PDSERVE_INTERNAL_TOKEN_OVERLAP
  value: {{ .Values.internalToken.rotationOverlapSeconds | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.tokenVolume" -}}
- name: internal-token
  secret:
    secretName: {{ .Values.internalToken.existingSecret | default (include "pdserve.secretName" .) }}
    items:
      - key: {{ if .Values.internalToken.existingSecret }}{{ .Values.internalToken.existingSecretKey }}{{ else }}internal-token{{ end }}
        path: token
{{- end -}}

{{- define "pdserve.apiKeyEnv" -}}
{{- if .Values.apiKey.enabled -}}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret | default (include "pdserve.secretName" .) }}
      key: {{ if .Values.apiKey.existingSecret }}{{ .Values.apiKey.existingSecretKey }}{{ else }}api-key{{ end }}
{{- end }}
{{- end -}}

{{/* A value as a flag's text: whole numbers without a decimal point, booleans on/off. */}}
{{- define "pdserve.flagValue" -}}
{{- if kindIs "bool" . -}}{{- ternary "on" "off" . -}}
{{- else if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}{{- int64 . -}}
{{- else -}}{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* (dict "values" MAP "keys" LIST): `--kebab-case=value` for each key set (not null). */}}
{{- define "pdserve.flags" -}}
{{- $values := .values -}}
{{- range $key := .keys }}
{{- $value := index $values $key }}
{{- if not (kindIs "invalid" $value) }}
- {{ printf "--%s=%s" (kebabcase $key) (include "pdserve.flagValue" $value) | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A worker's engine: the cluster's engine values, then its pool's. Its tensor-parallel
ranks share the pod's CPU: without numThreads, each takes the CPU request (rounded up, as
PDSERVE_NUM_THREADS has it) divided among them, at least 1. */}}
{{- define "pdserve.engineArgs" -}}
{{- $engine := mergeOverwrite (deepCopy .root.Values.engine) (.pool.engine | default dict) -}}
{{- $ranks := int ($engine.tensorParallelSize | default 1) -}}
{{- $cpu := dig "requests" "cpu" "" (.pool.resources | default dict) | toString -}}
{{- if and (gt $ranks 1) (kindIs "invalid" $engine.numThreads) $cpu -}}
{{- $millicores := hasSuffix "m" $cpu | ternary (trimSuffix "m" $cpu | float64) (mulf (float64 $cpu) 1000) -}}
{{- $cores := divf $millicores 1000 | ceil | int -}}
{{- $_ := set $engine "numThreads" (max 1 (div $cores $ranks)) -}}
{{- end -}}
{{- include "pdserve.flags" (dict "values" $engine "keys" (keys $engine | sortAlpha)) -}}
{{- end -}}

{{/* The flags every pdserve service takes the same way. */}}
{{- define "pdserve.commonArgs" -}}
{{ include "pdserve.logArgs" . }}
{{- if .Values.tls.enabled }}
- "--tls-cert=/etc/pdserve/tls/tls.crt"
- "--tls-key=/etc/pdserve/tls/tls.key"
- "--tls-ca=/etc/pdserve/tls/ca.crt"
{{- with .Values.tls.serverName }}
- {{ printf "--tls-server-name=%s" . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* How every pdserve process logs (the planner, which has no gRPC port, takes only these). */}}
{{- define "pdserve.logArgs" -}}
- {{ printf "--log-level=%s" .Values.logLevel | quote }}
- {{ printf "--log-format=%s" .Values.logFormat | quote }}
{{- end -}}

{{/* The checkpoint directory every pdserve container passes as --model. */}}
{{- define "pdserve.modelPath" -}}
{{- $dir := .Values.model.dir -}}
{{- if and (not $dir) (eq .Values.model.source "prepare") -}}{{- $dir = "models/SmolLM2-135M-Instruct" -}}{{- end -}}
{{- if $dir -}}{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) $dir -}}{{- else -}}{{- .Values.model.mountPath -}}{{- end -}}
{{- end -}}


{{/* The chart's own Secret's data, computed once per render (the pods' checksums must see
the same random values as the Secret): kept across upgrades from the Secret in the cluster
(a new internal token on every upgrade would make old and new pods refuse each other's
calls mid-rollout). */}}
{{- define "pdserve.secretData" -}}
{{- if not (hasKey .Values "__secretData") -}}
{{- $name := include "pdserve.secretName" . -}}
{{- $old := (lookup "v1" "Secret" .Release.Namespace $name).data | default dict -}}
{{- $data := dict -}}
{{- if and .Values.internalToken.enabled (not .Values.internalToken.existingSecret) -}}
{{- $_ := set $data "internal-token" (.Values.internalToken.value | default (get $old "internal-token" | b64dec) | default (randAlphaNum 48)) -}}
{{- end -}}
{{- if and .Values.apiKey.enabled (not .Values.apiKey.existingSecret) -}}
{{- $_ := set $data "api-key" (.Values.apiKey.value | default (get $old "api-key" | b64dec) | default (printf "pds-%s" (randAlphaNum 40))) -}}
{{- end -}}
{{- if and .Values.redis.url (not .Values.redis.existingSecret) -}}
{{- $_ := set $data "redis-url" .Values.redis.url -}}
{{- end -}}
{{- if include "pdserve.builtinRedis" . -}}
{{- /* The built-in Valkey asks every client for a password: a pod that can reach it
cannot read or write the registry without this Secret. */ -}}
{{- $password := .Values.redis.password | default (get $old "redis-password" | b64dec) | default (randAlphaNum 40) -}}
{{- $_ := set $data "redis-password" $password -}}
{{- $_ := set $data "redis-url" (printf "redis://:%s@%s:6379/0" (urlquery $password) (include "pdserve.redisService" .)) -}}
{{- end -}}
{{- $_ := set .Values "__secretData" $data -}}
{{- end -}}
{{- toYaml (get .Values "__secretData") -}}
{{- end -}}

{{/* What a pod reads once at start from the chart's Secret, hashed: a change restarts the
pool (the internal token and the TLS files are followed in place, so they are not in it).
Values in Secrets of your own are not seen here: restart the pools after changing those. */}}
{{- define "pdserve.restartChecksum" -}}
{{- $data := include "pdserve.secretData" .root | fromYaml -}}
{{- $keys := list "redis-url" -}}
{{- if eq .component "gateway" }}{{ $keys = append $keys "api-key" }}{{ end -}}
{{- if eq .component "redis" }}{{ $keys = list "redis-password" }}{{ end -}}
{{- $parts := list -}}
{{- range $keys }}{{ $parts = append $parts (printf "%s=%s" . (get $data . | default "")) }}{{ end -}}
{{- join "\n" $parts | sha256sum -}}
{{- end -}}
