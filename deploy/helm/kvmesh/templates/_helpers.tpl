{{/* The components: chart name → values key and the role its identity carries (kvmesh.security); the planner
     only with planner.enabled. Args: the root context, or a dict holding it as root. */}}
{{- define "kvmesh.components" -}}
{{- $root := .root | default . }}
router: {key: router, role: router}
cache-manager: {key: cacheManager, role: cache-manager}
worker: {key: worker, role: worker}
failover: {key: failover, role: failover}
{{- if $root.Values.planner.enabled }}
planner: {key: planner, role: planner}
{{- end }}
{{- end -}}

{{/* Resource name of a component in a zone: <release>-<zone>-<component>. Args: root, zone, name. */}}
{{- define "kvmesh.fullname" -}}
{{ .root.Release.Name }}-{{ .zone.name }}-{{ .name }}
{{- end -}}

{{- define "kvmesh.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/name: kvmesh-{{ .name }}
kvmesh.io/zone: {{ .zone.name }}
{{- end -}}

{{- define "kvmesh.labels" -}}
{{ include "kvmesh.selector" . }}
app.kubernetes.io/part-of: kvmesh
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
kvmesh.io/version: {{ .root.Values.version }}
{{- end -}}

{{/* Every pod of a zone in the release (a NetworkPolicy peer). Args: root, zone, name ("" = any component). */}}
{{- define "kvmesh.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/instance: {{ .root.Release.Name }}
      {{- if .name }}
      app.kubernetes.io/name: kvmesh-{{ .name }}
      {{- end }}
      {{- if .zone }}
      kvmesh.io/zone: {{ .zone.name }}
      {{- end }}
{{- end -}}

{{- define "kvmesh.consulUrl" -}}
{{- if .Values.consul.enabled -}}http://{{ .Release.Name }}-consul-server:8500{{- else -}}{{ required "consul.url is required when consul.enabled=false" .Values.consul.url }}{{- end -}}
{{- end -}}

{{- define "kvmesh.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://{{ .Release.Name }}-redis-master:6379/0{{- else -}}{{ required "redis.url is required when redis.enabled=false" .Values.redis.url }}{{- end -}}
{{- end -}}

{{/* Environment shared by every service (read as KVMESH_* settings, kvmesh.core.config). Args: root, zone, name. */}}
{{- define "kvmesh.commonEnv" -}}
{{- $v := .root.Values }}
{{- $c := index (include "kvmesh.components" . | fromYaml) .name }}
{{- $cv := index $v $c.key }}
- name: KVMESH_SERVICE_ID
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: KVMESH_HOST
  value: "0.0.0.0"
- name: HOME                    # the root filesystem is read-only: caches (vLLM, torch) go to the /tmp volume
  value: /tmp
- name: KVMESH_PORT
  value: {{ $cv.grpcPort | quote }}
- name: KVMESH_HTTP_PORT
  value: {{ $cv.httpPort | quote }}
# peers dial this pod by its own DNS name (the headless Service <name>-pods): a name its certificate carries
- name: KVMESH_ADVERTISE_ADDRESS
  value: "$(KVMESH_SERVICE_ID).{{ include "kvmesh.fullname" . }}-pods.$(POD_NAMESPACE).svc:{{ $cv.grpcPort }}"
- name: KVMESH_ZONE
  value: {{ .zone.name | quote }}
- name: KVMESH_VERSION
  value: {{ $v.version | quote }}
- name: KVMESH_LOG_FORMAT
  value: {{ $v.telemetry.logFormat | quote }}
- name: KVMESH_OTLP_ENDPOINT
  value: {{ $v.telemetry.otlpEndpoint | quote }}
{{- if ne .name "planner" }}{{/* the planner finds its zone's router by name, not in Consul */}}
- name: KVMESH_CONSUL_URL
  value: {{ include "kvmesh.consulUrl" .root | quote }}
{{- end }}
- name: KVMESH_AUTH_MODE
  value: {{ $v.auth.mode | quote }}
{{- if $v.tls.enabled }}
{{- range $var, $file := dict "KVMESH_TLS_CERT" "tls.crt" "KVMESH_TLS_KEY" "tls.key" "KVMESH_TLS_CLIENT_CA" "ca.crt" "KVMESH_TLS_CA" "ca.crt" "KVMESH_TLS_CLIENT_CERT" "tls.crt" "KVMESH_TLS_CLIENT_KEY" "tls.key" }}
- name: {{ $var }}
  value: /etc/kvmesh/tls/{{ $file }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Per-component environment. Args: root, zone, name. */}}
{{- define "kvmesh.env.router" -}}
{{- $v := .root.Values }}
- name: KVMESH_CACHE_MANAGER
  value: "{{ include "kvmesh.fullname" (dict "root" .root "zone" .zone "name" "cache-manager") }}:{{ $v.cacheManager.grpcPort }}"
- name: KVMESH_FAILOVER
  value: "{{ include "kvmesh.fullname" (dict "root" .root "zone" .zone "name" "failover") }}:{{ $v.failover.grpcPort }}"
- name: KVMESH_ROUTER_REPLICAS
  value: {{ $v.router.replicas | quote }}
- name: KVMESH_MODEL
  value: {{ $v.model.path | quote }}
- name: KVMESH_MODEL_NAME
  value: {{ $v.model.name | quote }}
- name: KVMESH_SALT_MODEL
  value: {{ $v.model.name | quote }}
- name: KVMESH_BLOCK_SIZE
  value: {{ $v.model.blockSize | quote }}
- name: KVMESH_LONG_PROMPT_TOKENS
  value: {{ $v.router.longPromptTokens | quote }}
- name: KVMESH_WORKER_TRANSPORT
  value: {{ $v.router.workerTransport | quote }}
{{- if gt (int $v.router.processes) 1 }}
- name: KVMESH_PROCESSES
  value: {{ $v.router.processes | quote }}
- name: KVMESH_PROCESS_HTTP_PORT
  value: {{ $v.router.processMetricsPort | quote }}
{{- end }}
{{- if $v.router.apiKeysSecret }}
- name: KVMESH_API_KEYS_FILE
  value: /etc/kvmesh/keys/keys
{{- end }}
{{- end -}}

{{- define "kvmesh.env.cache-manager" -}}
{{- $v := .root.Values }}
- name: KVMESH_REDIS_URL
  value: {{ include "kvmesh.redisUrl" .root | quote }}
- name: KVMESH_REDIS_PREFIX
  value: "kvmesh:cm:{{ .zone.name }}"
- name: KVMESH_BLOCK_SIZE
  value: {{ $v.model.blockSize | quote }}
- name: KVMESH_MODEL
  value: {{ $v.model.name | quote }}
- name: KVMESH_CHECKPOINT_INTERVAL_S
  value: {{ $v.cacheManager.checkpointIntervalS | quote }}
{{- /* active-active zones (docs/zones.md): follow every other zone's cache-manager, replicate hot prefixes into it */}}
{{- $others := list }}
{{- range $z := $v.zones }}
{{- if ne $z.name $.zone.name }}
{{- $others = append $others (printf "%s=%s:%v" $z.name (include "kvmesh.fullname" (dict "root" $.root "zone" $z "name" "cache-manager")) $v.cacheManager.grpcPort) }}
{{- end }}
{{- end }}
{{- if $others }}
- name: KVMESH_FOLLOW_ZONE
  value: {{ join "," $others | quote }}
- name: KVMESH_REPLICATION_BYTES_PER_S
  value: {{ $v.cacheManager.replicationBytesPerS | int64 | quote }}
{{- end }}
{{- end -}}

{{- define "kvmesh.env.worker" -}}
{{- $v := .root.Values }}
- name: KVMESH_ENGINE
  value: {{ $v.worker.engine | quote }}
- name: KVMESH_MODEL
  value: {{ $v.model.path | quote }}
- name: KVMESH_BLOCK_SIZE
  value: {{ $v.model.blockSize | quote }}
- name: KVMESH_CACHE_MANAGER
  value: "{{ include "kvmesh.fullname" (dict "root" .root "zone" .zone "name" "cache-manager") }}:{{ $v.cacheManager.grpcPort }}"
- name: KVMESH_KVSYNC_PORT
  value: {{ $v.worker.kvsyncPort | quote }}
- name: KVMESH_FRAMES_PORT
  value: {{ if eq $v.router.workerTransport "frames" }}{{ $v.worker.framesPort | quote }}{{ else }}"-1"{{ end }}
- name: KVMESH_GRACE_S
  value: "45"
- name: KVMESH_VLLM_ARGS
  value: "--tensor-parallel-size {{ $v.worker.tensorParallelSize }} {{ $v.worker.vllmArgs }}"
# cost rules (deploy/prometheus/alerts.yaml): the GPUs the pod is billed for, at the configured GPU-hour price
- name: KVMESH_GPUS
  value: {{ $v.worker.gpusPerWorker | quote }}
- name: KVMESH_GPU_HOUR_PRICE
  value: {{ $v.worker.gpuHourPrice | quote }}
# prefill/decode disaggregation: this Deployment's role (kvmesh.workerPools); a disaggregated worker's host label
# is its node (the handoff's link cost: same host, else same zone)
- name: KVMESH_ROLE
  value: {{ .role | quote }}
{{- if ne .role "both" }}
- name: KVMESH_HOST_LABEL
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
{{- end }}
{{- if eq .role "prefill" }}
# a prefill worker hands its prompts' KV over from its CPU tier (kv-sync): in the pod's /dev/shm
- name: KVMESH_CPU_TIER_MB
  value: {{ $v.worker.prefillCpuTierMb | quote }}
{{- end }}
{{- end -}}

{{/* A zone's worker Deployments as role: replicas. `worker.replicas` workers of role both (aggregated) unless
     the zone has prefill/decode pools: `worker.prefillReplicas` / `worker.decodeReplicas`, each overridable per
     zone (`zones[].worker`); prefill workers without decode workers are refused. Args: root, zone. */}}
{{- define "kvmesh.workerPools" -}}
{{- $keys := list "replicas" "prefillReplicas" "decodeReplicas" }}
{{- $own := .zone.worker | default dict }}
{{- range $k, $_ := $own }}
{{- if not (has $k $keys) }}{{ fail (printf "zones[%s].worker.%s: unknown key (known: %s)" $.zone.name $k (join ", " $keys)) }}{{ end }}
{{- end }}
{{- $w := merge (deepCopy $own) (pick .root.Values.worker "replicas" "prefillReplicas" "decodeReplicas") }}
{{- range $k := $keys }}
{{- if lt (int (index $w $k | default 0)) 0 }}{{ fail (printf "zones[%s].worker.%s: must be >= 0, got %v" $.zone.name $k (index $w $k)) }}{{ end }}
{{- end }}
{{- $p := int ($w.prefillReplicas | default 0) }}
{{- $d := int ($w.decodeReplicas | default 0) }}
{{- if and (gt $p 0) (eq $d 0) }}{{ fail (printf "zones[%s].worker: %d prefill workers and no decode worker: set decodeReplicas too (a prefill worker only computes prompts for decode workers)" .zone.name $p) }}{{ end }}
{{- if and (gt $p 0) (not (gt (float64 .root.Values.worker.prefillCpuTierMb) 0.0)) }}{{ fail "worker.prefillCpuTierMb: must be > 0 (prefill workers hand their KV over from their CPU tier)" }}{{ end }}
{{- if or (gt $p 0) (gt $d 0) }}
decode: {{ $d }}
{{- if gt $p 0 }}
prefill: {{ $p }}
{{- end }}
{{- else }}
both: {{ int $w.replicas }}
{{- end }}
{{- end -}}

{{- define "kvmesh.env.failover" -}}
{{- $v := .root.Values }}
- name: KVMESH_HEALTH_INTERVAL_S
  value: {{ $v.failover.healthIntervalS | quote }}
- name: KVMESH_ZONES
  value: {{ include "kvmesh.zoneNames" .root | quote }}
{{- end -}}

{{/* The zone's planner: it scales the zone's worker Deployment (its Role allows exactly that) by the
     forecast of the zone's router's load (docs/operations.md). */}}
{{- define "kvmesh.env.planner" -}}
{{- $v := .root.Values }}
- name: KVMESH_ROUTERS
  value: "{{ .zone.name }}={{ include "kvmesh.fullname" (dict "root" .root "zone" .zone "name" "router") }}:{{ $v.router.grpcPort }}"
- name: KVMESH_ACTUATOR
  value: kubernetes
- name: KVMESH_KUBE_DEPLOYMENTS
  value: "{{ .zone.name }}={{ include "kvmesh.fullname" (dict "root" .root "zone" .zone "name" "worker") }}"
- name: KVMESH_PER_WORKER_RPS
  value: {{ $v.planner.perWorkerRps | quote }}
- name: KVMESH_MIN_WORKERS
  value: {{ $v.planner.minWorkers | quote }}
- name: KVMESH_MAX_WORKERS
  value: {{ $v.planner.maxWorkers | quote }}
- name: KVMESH_BUFFER
  value: {{ $v.planner.buffer | quote }}
- name: KVMESH_LEAD_S
  value: {{ $v.planner.leadS | quote }}
- name: KVMESH_INTERVAL_S
  value: {{ $v.planner.intervalS | quote }}
- name: KVMESH_HISTORY_FILE
  value: /var/lib/kvmesh-planner/history.json
{{- if hasKey (include "kvmesh.workerPools" . | fromYaml) "prefill" }}
# a disaggregated zone: the prefill and decode pools sized apart; role changes are reported, not carried out
# (the actuator scales the zone's worker Deployment: its decode pool)
- name: KVMESH_POOLS
  value: "true"
{{- end }}
{{- end -}}

{{- define "kvmesh.zoneNames" -}}
{{- $names := list }}{{ range .Values.zones }}{{ $names = append $names .name }}{{ end }}{{ join "," $names }}
{{- end -}}

{{/* A probe's handler: grpc.health.v1 on the service's gRPC port (every kvmesh server serves it). The kubelet's
     gRPC probes speak no TLS, so with tls.enabled (that port is mTLS only) the probe is GET /healthz over HTTPS
     on the HTTP port (HTTPS only under TLS; the kubelet checks no certificate and a client certificate is
     optional there; open in the authorisation table; SERVING, or 503 once draining). Args: root, zone, name. */}}
{{- define "kvmesh.probe" -}}
{{- $v := index .root.Values (index (include "kvmesh.components" . | fromYaml) .name).key }}
{{- if .root.Values.tls.enabled -}}
httpGet: {path: /healthz, port: {{ $v.httpPort }}, scheme: HTTPS}
{{- else -}}
grpc: {port: {{ $v.grpcPort }}, service: ""}
{{- end }}
{{- end -}}

{{- /* The router's per-process metrics ports (router.processes > 1), as a YAML list of {name, port}. */}}
{{- define "kvmesh.processPorts" -}}
{{- $r := .Values.router }}
{{- if lt (int $r.processes) 1 }}{{ fail (printf "router.processes: must be >= 1 (one per core is not known to the chart), got %v" $r.processes) }}{{ end }}
{{- if gt (int $r.processes) 1 }}
{{- range $i := until (int $r.processes) }}
- {name: metrics-{{ $i }}, port: {{ add $r.processMetricsPort $i }}}
{{- end }}
{{- end }}
{{- end -}}
