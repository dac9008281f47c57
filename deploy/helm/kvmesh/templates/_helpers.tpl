{{- define "kvmesh.labels" -}}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/instance: {{ .Release.Name }}
kvmesh.io/zone: {{ .Values.zone }}
kvmesh.io/version: {{ .Values.version }}
{{- end -}}

{{- define "kvmesh.consulUrl" -}}
{{- if .Values.consul.enabled -}}http://{{ .Release.Name }}-consul-server:8500{{- else -}}{{ .Values.consul.url }}{{- end -}}
{{- end -}}

{{- define "kvmesh.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://{{ .Release.Name }}-redis-master:6379/0{{- else -}}{{ .Values.redis.url }}{{- end -}}
{{- end -}}

{{/* Environment shared by every service (read as KVMESH_* settings). */}}
{{- define "kvmesh.commonEnv" -}}
- name: KVMESH_HOST
  value: "0.0.0.0"
- name: KVMESH_ZONE
  value: {{ .Values.zone | quote }}
- name: KVMESH_VERSION
  value: {{ .Values.version | quote }}
- name: KVMESH_LOG_FORMAT
  value: {{ .Values.telemetry.logFormat | quote }}
- name: KVMESH_OTLP_ENDPOINT
  value: {{ .Values.telemetry.otlpEndpoint | quote }}
- name: KVMESH_CONSUL_URL
  value: {{ include "kvmesh.consulUrl" . | quote }}
- name: KVMESH_SERVICE_ID
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: KVMESH_AUTH_MODE
  value: {{ .Values.auth.mode | quote }}
{{- if .Values.tls.enabled }}
- name: KVMESH_TLS_CERT
  value: /etc/kvmesh/tls/tls.crt
- name: KVMESH_TLS_KEY
  value: /etc/kvmesh/tls/tls.key
- name: KVMESH_TLS_CLIENT_CA
  value: /etc/kvmesh/tls/ca.crt
- name: KVMESH_TLS_CA
  value: /etc/kvmesh/tls/ca.crt
- name: KVMESH_TLS_CLIENT_CERT
  value: /etc/kvmesh/tls/tls.crt
- name: KVMESH_TLS_CLIENT_KEY
  value: /etc/kvmesh/tls/tls.key
{{- end }}
{{- end -}}

{{- define "kvmesh.router.env" -}}
- name: KVMESH_CACHE_MANAGER
  value: "{{ .Release.Name }}-cache-manager:{{ .Values.cacheManager.grpcPort }}"
- name: KVMESH_FAILOVER
  value: "{{ .Release.Name }}-failover:{{ .Values.failover.grpcPort }}"
- name: KVMESH_MODEL
  value: {{ .Values.model.path | quote }}
- name: KVMESH_MODEL_NAME
  value: {{ .Values.model.name | quote }}
- name: KVMESH_BLOCK_SIZE
  value: {{ .Values.model.blockSize | quote }}
- name: KVMESH_LONG_PROMPT_TOKENS
  value: {{ .Values.router.longPromptTokens | quote }}
{{- if .Values.router.apiKeysSecret }}
- name: KVMESH_API_KEYS_FILE
  value: /etc/kvmesh/keys/keys
{{- end }}
{{- end -}}

{{- define "kvmesh.cache-manager.env" -}}
- name: KVMESH_REDIS_URL
  value: {{ include "kvmesh.redisUrl" . | quote }}
- name: KVMESH_BLOCK_SIZE
  value: {{ .Values.model.blockSize | quote }}
- name: KVMESH_MODEL
  value: {{ .Values.model.name | quote }}
- name: KVMESH_CHECKPOINT_INTERVAL_S
  value: {{ .Values.cacheManager.checkpointIntervalS | quote }}
{{- end -}}

{{- define "kvmesh.worker.env" -}}
- name: KVMESH_ENGINE
  value: {{ .Values.worker.engine | quote }}
- name: KVMESH_MODEL
  value: {{ .Values.model.path | quote }}
- name: KVMESH_BLOCK_SIZE
  value: {{ .Values.model.blockSize | quote }}
- name: KVMESH_CACHE_MANAGER
  value: "{{ .Release.Name }}-cache-manager:{{ .Values.cacheManager.grpcPort }}"
- name: KVMESH_VLLM_ARGS
  value: "--tensor-parallel-size {{ .Values.worker.tensorParallelSize }} {{ .Values.worker.vllmArgs }}"
{{- end -}}

{{- define "kvmesh.failover.env" -}}
- name: KVMESH_HEALTH_INTERVAL_S
  value: {{ .Values.failover.healthIntervalS | quote }}
{{- end -}}
