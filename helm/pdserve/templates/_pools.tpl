{{/* The pools this release runs, in order: the same list for HPAs, PDBs and monitors. */}}
{{- define "pdserve.pools" -}}
{{- if .Values.disaggregation -}}
gateway: {}
prefill: {}
decode: {}
kvstore: {}
{{- else -}}
gateway: {}
decode: {}
{{- end -}}
{{- end -}}

{{/* (dict "root" $ "component" POOL): what sets the pool's replicas. "keda" or "hpa": its
autoscaling block (autoscaling.mode hpa); "planner": the planner (autoscaling.mode planner,
the prefill and decode pools); "": the chart, from its replicas. One owner per pool. */}}
{{- define "pdserve.scaledBy" -}}
{{- $mode := .root.Values.autoscaling.mode -}}
{{- $scaling := (index .root.Values .component).autoscaling -}}
{{- $planned := and (eq $mode "planner") (has .component (list "prefill" "decode")) -}}
{{- if $planned -}}
{{- if or $scaling.enabled $scaling.keda.enabled -}}
{{- $why := "two owners of one pool's replicas would fight; its minReplicas and maxReplicas still bound the planner" -}}
{{- fail (printf "autoscaling.mode planner sizes the %s pool: set %s.autoscaling.enabled and %s.autoscaling.keda.enabled to false (%s)" .component .component .component $why) -}}
{{- end -}}
planner
{{- else if eq $mode "off" -}}
{{- else if $scaling.keda.enabled -}}
keda
{{- else if $scaling.enabled -}}
hpa
{{- end -}}
{{- end -}}
