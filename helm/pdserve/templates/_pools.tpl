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
