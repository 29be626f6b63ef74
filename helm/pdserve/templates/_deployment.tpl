{{/*
The Deployment of one pdserve pool; every pool is this one shape.
(dict "root" $ "component" NAME "pool" VALUES "command" LIST "args" LIST
      "env" YAML-LIST "ports" LIST-OF-(name, port) "probePort" NAME "probe" "grpc"|"http"
      "engine" BOOL "model" BOOL "publicTls" SECRET-NAME-OR-EMPTY)
*/}}
{{- define "pdserve.deployment" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $name := printf "%s-%s" (include "pdserve.fullname" $root) .component -}}
{{- $scaled := include "pdserve.scaledBy" (dict "root" $root "component" .component) -}}
{{- $grace := add (int $pool.drainTimeout) (int $root.Values.preStopSleepSeconds) 15 -}}
{{- $prepare := and .model (eq $root.Values.model.source "prepare") -}}
{{- $cpuRequest := dig "requests" "cpu" "" ($pool.resources | default dict) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "pdserve.componentLabels" (dict "root" $root "component" .component) | nindent 4 }}
spec:
  {{- if not $scaled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  revisionHistoryLimit: 3
  strategy:
    {{- toYaml $pool.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" (dict "root" $root "component" .component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.selectorLabels" (dict "root" $root "component" .component) | nindent 8 }}
        app.kubernetes.io/part-of: pdserve
        {{- with $pool.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        # What this pod reads once at start (the API key, the Redis URL): a change rolls it.
        checksum/secrets: {{ include "pdserve.restartChecksum" (dict "root" $root "component" .component) }}
        {{- with $pool.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      {{- with $root.Values.serviceAccountName }}
      serviceAccountName: {{ . }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $pool.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $pool.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      # Above --drain-timeout plus the preStop pause: SIGTERM drains, it is not cut short.
      terminationGracePeriodSeconds: {{ $grace }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $pool.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml $pool.topologySpreadConstraints | nindent 8 }}
      {{- else if $root.Values.spreadPodsByNode }}
      # The pool's pods on different nodes where the scheduler can: a node lost takes one.
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: kubernetes.io/hostname
          whenUnsatisfiable: ScheduleAnyway
          labelSelector:
            matchLabels:
              {{- include "pdserve.selectorLabels" (dict "root" $root "component" .component) | nindent 14 }}
      {{- end }}
      {{- if $prepare }}
      initContainers:
        - name: prepare-model
          image: {{ include "pdserve.engineImage" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["pdserve", "prepare-model"]
          args:
            - {{ printf "--home=%s" $root.Values.model.mountPath | quote }}
            - "--quiet=on"
          resources:
            {{- toYaml $root.Values.model.prepare.resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - {name: model, mountPath: {{ $root.Values.model.mountPath }}}
            - {name: cache, mountPath: /var/cache/pdserve}
            - {name: tmp, mountPath: /tmp}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "pdserve.image" (dict "root" $root "pool" $pool) }}
          imagePullPolicy: {{ include "pdserve.pullPolicy" (dict "root" $root "pool" $pool) }}
          command:
            {{- toYaml .command | nindent 12 }}
          {{- $args := concat .args (include "pdserve.commonArgs" $root | fromYamlArray) }}
          {{- if and $root.Values.tls.enabled $root.Values.tls.mutual (ne .component "gateway") }}
          {{- /* Internal ports only: the gateway's gRPC front is public. */}}
          {{- $args = append $args "--tls-client-ca=/etc/pdserve/tls/ca.crt" }}
          {{- end }}
          args:
            {{- concat $args ($pool.extraArgs | default list) | toYaml | nindent 12 }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef: {fieldPath: status.podIP}
            {{- if and .engine $cpuRequest }}
            # Torch's threads: the CPU this pod is given, not every core of its node.
            - name: PDSERVE_NUM_THREADS
              valueFrom:
                resourceFieldRef: {resource: requests.cpu, divisor: "1"}
            {{- end }}
            {{- include "pdserve.redisEnv" $root | nindent 12 }}
            {{- with include "pdserve.tokenEnv" $root }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with .env }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $pool.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- range .ports }}
            - {name: {{ .name }}, containerPort: {{ .port }}, protocol: TCP}
            {{- end }}
          {{- $check := dict }}
          {{- $scheme := ternary "HTTPS" "HTTP" (not (empty .publicTls)) }}
          {{- if eq .probe "http" }}
          {{- $check = dict "httpGet" (dict "path" "/health" "port" .probePort "scheme" $scheme) }}
          {{- else if $root.Values.tls.enabled }}
          {{- /* Kubernetes' gRPC probe speaks plaintext: the same health over HTTP on the
          metrics port (503 once the service drains). */}}
          {{- $check = dict "httpGet" (dict "path" "/health" "port" "metrics") }}
          {{- else }}
          {{- $check = dict "grpc" (dict "port" (int .probePortNumber)) }}
          {{- end }}
          {{- /* Readiness may ask more than liveness (the gateway: a routable decode worker). */}}
          {{- $ready := $check }}
          {{- with .readyPath }}
          {{- $ready = dict "httpGet" (dict "path" . "port" $.probePort "scheme" $scheme) }}
          {{- end }}
          {{- $probes := $pool.probes | default dict }}
          {{- $startup := dict "periodSeconds" 5 "timeoutSeconds" 3 "failureThreshold" (max 1 (div (add (int $pool.startupProbeSeconds) 4) 5)) }}
          startupProbe:
            {{- toYaml (mergeOverwrite (deepCopy $check) $startup ($probes.startup | default dict)) | nindent 12 }}
          readinessProbe:
            {{- toYaml (mergeOverwrite (deepCopy $ready) (dict "periodSeconds" 5 "timeoutSeconds" 3 "failureThreshold" 2) ($probes.readiness | default dict)) | nindent 12 }}
          livenessProbe:
            {{- toYaml (mergeOverwrite (deepCopy $check) (dict "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" 3) ($probes.liveness | default dict)) | nindent 12 }}
          lifecycle:
            preStop:
              sleep: {seconds: {{ $root.Values.preStopSleepSeconds }}}
          resources:
            {{- toYaml $pool.resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            {{- if .model }}
            - {name: model, mountPath: {{ $root.Values.model.mountPath }}, readOnly: {{ not $prepare }}}
            {{- end }}
            - {name: cache, mountPath: /var/cache/pdserve}
            - {name: tmp, mountPath: /tmp}
            {{- if $root.Values.tls.enabled }}
            - {name: tls, mountPath: /etc/pdserve/tls, readOnly: true}
            {{- end }}
            {{- if .publicTls }}
            - {name: public-tls, mountPath: /etc/pdserve/public-tls, readOnly: true}
            {{- end }}
            {{- if $root.Values.internalToken.enabled }}
            - {name: internal-token, mountPath: /etc/pdserve/internal-token, readOnly: true}
            {{- end }}
            {{- if $pool.shmSize }}
            - {name: dshm, mountPath: /dev/shm}
            {{- end }}
            {{- with $pool.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        {{- with $pool.extraContainers }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      volumes:
        {{- if .model }}
        - name: model
          {{- include "pdserve.modelVolume" $root | nindent 10 }}
        {{- end }}
        - name: cache
          emptyDir: {sizeLimit: {{ $root.Values.cacheSizeLimit }}}
        - name: tmp
          emptyDir: {sizeLimit: 1Gi}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          secret: {secretName: {{ $root.Values.tls.secretName }}}
        {{- end }}
        {{- with .publicTls }}
        - name: public-tls
          secret: {secretName: {{ . }}}
        {{- end }}
        {{- if $root.Values.internalToken.enabled }}
        {{- include "pdserve.tokenVolume" $root | nindent 8 }}
        {{- end }}
        {{- with $pool.shmSize }}
        - name: dshm
          emptyDir: {medium: Memory, sizeLimit: {{ . }}}
        {{- end }}
        {{- with $pool.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{- define "pdserve.modelVolume" -}}
{{- $model := .Values.model -}}
{{- if eq $model.source "hostPath" -}}
hostPath: {path: {{ $model.hostPath.path | quote }}, type: Directory}
{{- else if eq $model.source "pvc" -}}
persistentVolumeClaim: {claimName: {{ $model.pvc.claimName }}, readOnly: true}
{{- else if $model.pvc.claimName -}}
persistentVolumeClaim: {claimName: {{ $model.pvc.claimName }}}
{{- else -}}
emptyDir: {sizeLimit: {{ $model.sizeLimit }}}
{{- end -}}
{{- end -}}
