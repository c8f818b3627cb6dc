{{/* Names: every object is "<fullname>-<component>"; fullname is the release name by default. */}}
{{- define "kvroute.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.labels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (list $ "ext-proc"). */}}
{{- define "kvroute.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvroute.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvroute.agentTokenSecret" -}}
{{- .Values.agentToken.existingSecret | default (printf "%s-agent-token" (include "kvroute.fullname" .)) -}}
{{- end -}}

{{- define "kvroute.queryTokenSecret" -}}
{{- .Values.queryToken.existingSecret | default (printf "%s-query-token" (include "kvroute.fullname" .)) -}}
{{- end -}}

{{- define "kvroute.extProcTlsSecret" -}}
{{- .Values.extProc.tls.secretName -}}
{{- end -}}
{{- define "kvroute.extProcTlsDir" -}}/var/run/secrets/kvroute-ext-proc-tls{{- end -}}

{{/* Where the Secrets are mounted (key `token`). */}}
{{- define "kvroute.agentTokenDir" -}}/var/run/secrets/kvroute-agent{{- end -}}
{{- define "kvroute.queryTokenDir" -}}/var/run/secrets/kvroute-query{{- end -}}

{{/* The index pods' stable names, one gRPC URL each (agents stream to every pod; ext-proc
     tries them in order). */}}
{{- define "kvroute.indexUrls" -}}
{{- $fullname := include "kvroute.fullname" . -}}
{{- range $i := until (int .Values.index.replicas) }}
{{ printf "- http://%s-index-%d.%s-index-headless.%s.svc:%d" $fullname $i $fullname $.Release.Namespace (int $.Values.index.grpcPort) }}
{{- end -}}
{{- end -}}

{{/* The pool schema ext-proc and the index share (kvroute_block_keys::schema). */}}
{{- define "kvroute.poolSchema" -}}
name: {{ .Values.pool.name | quote }}
models: {{ toJson .Values.pool.models }}
block_size: {{ .Values.pool.blockSize }}
key_scheme: {{ toJson .Values.pool.keyScheme }}
{{- end -}}

{{/* Pod hardening shared by every kvroute container. */}}
{{- define "kvroute.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: [ALL]}
{{- end -}}
{{- define "kvroute.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* The `kubernetes:` discovery section every kvroute component reads (kvroute_discovery::config):
     the pool's pods in the release namespace, through the InferencePool or the label selector.
     In-cluster connection: each pod's service account (rbac.yaml). One line of JSON. */}}
{{- define "kvroute.discovery" -}}
{{- $kubernetes := dict "namespace" .Release.Namespace -}}
{{- if eq .Values.pool.discovery "inferencePool" -}}
{{- $_ := set $kubernetes "inference_pool" .Values.pool.name -}}
{{- else if eq .Values.pool.discovery "selector" -}}
{{- $_ := set $kubernetes "selector" .Values.pool.selector -}}
{{- $_ := set $kubernetes "target_port" .Values.pool.targetPort -}}
{{- else -}}
{{- fail (printf "pool.discovery: %q is neither inferencePool nor selector" .Values.pool.discovery) -}}
{{- end -}}
{{- toJson (dict "kubernetes" $kubernetes) -}}
{{- end -}}

{{/* kvroute-ext-proc's config (ext-proc/src/config.rs). The pool's replicas are discovered:
     routed at podIP:targetPort, scraped at their /metrics. */}}
{{- define "kvroute.extProcConfig" -}}
listen:
  grpc: "0.0.0.0:{{ .Values.extProc.grpcPort }}"
  admin: "0.0.0.0:{{ .Values.extProc.adminPort }}"
  health: "0.0.0.0:{{ .Values.extProc.healthPort }}"
{{- if eq .Values.extProc.tls.mode "selfSigned" }}
  secure_serving: true
{{- else if eq .Values.extProc.tls.mode "secret" }}
  tls: {cert: {{ include "kvroute.extProcTlsDir" . }}/tls.crt, key: {{ include "kvroute.extProcTlsDir" . }}/tls.key}
{{- else if ne .Values.extProc.tls.mode "none" }}
{{- fail (printf "extProc.tls.mode: %q is none, selfSigned or secret" .Values.extProc.tls.mode) }}
{{- end }}
index:
  addresses:
{{- include "kvroute.indexUrls" . | trim | nindent 4 }}
  match_timeout: {{ .Values.extProc.matchTimeout }}
  token_file: {{ include "kvroute.queryTokenDir" . }}/token
pools:
  - {{ include "kvroute.poolSchema" . | indent 4 | trim }}
    tokenizer: {{ toJson .Values.pool.tokenizer }}
    discovery: {{ include "kvroute.discovery" . }}
log: {format: {{ .Values.log.format }}}
{{- with .Values.extProc.extraConfig }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* kvroute-index's config (index-service/src/config.rs). With agents, each node's agent
     (id = node name) feeds the discovered replicas on its node, all with one token; without,
     the index subscribes to each discovered pod's KV-event ports itself. */}}
{{- define "kvroute.indexConfig" -}}
listen: {grpc: "0.0.0.0:{{ .Values.index.grpcPort }}", admin: "0.0.0.0:{{ .Values.index.adminPort }}"}
query_auth: {token_file: {{ include "kvroute.queryTokenDir" . }}/token}
limits:
  max_blocks_per_replica: {{ int .Values.index.limits.max_blocks_per_replica }}
  agent_stale_grace: {{ .Values.index.limits.agent_stale_grace }}
pools:
  - {{ include "kvroute.poolSchema" . | indent 4 | trim }}
    discovery: {{ include "kvroute.discovery" . }}
{{- with .Values.pool.attentionChunkSize }}
    attention_chunk_size: {{ int . }}
{{- end }}
{{- if .Values.agent.enabled }}
node_agents: {token_file: {{ include "kvroute.agentTokenDir" . }}/token}
{{- end }}
log: {format: {{ .Values.log.format }}}
{{- with .Values.index.extraConfig }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* kvroute-agent's config (index-service/agent/src/config.rs): one file for every node. The
     agent id is the node name (NODE_NAME), and discovery without node_name watches the pods
     on the agent's own node. */}}
{{/* The `OTEL_*` variables of every kvroute container (`otel.env`), as env entries. */}}
{{- define "kvroute.otelEnv" -}}
{{- range $name, $value := .Values.otel.env }}
- {name: {{ $name }}, value: {{ $value | quote }}}
{{- end }}
{{- end -}}

{{- define "kvroute.agentConfig" -}}
agent_id_env: NODE_NAME
token_file: {{ include "kvroute.agentTokenDir" . }}/token
indexes:
{{- include "kvroute.indexUrls" . | trim | nindent 2 }}
admin: "0.0.0.0:{{ .Values.agent.adminPort }}"
batch_delay: {{ .Values.agent.batchDelay }}
max_blocks_per_replica: {{ int .Values.agent.maxBlocksPerReplica }}
engines: []
discovery: {{ include "kvroute.discovery" . }}
log: {format: {{ .Values.log.format }}}
{{- end -}}
