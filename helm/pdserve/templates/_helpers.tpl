{{/* Names and labels */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* component selector labels: (dict "ctx" $ "component" "gateway") */}}
{{- define "pdserve.componentSelector" -}}
{{ include "pdserve.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Worker pools of the selected mode, as a space-separated list of values keys */}}
{{- define "pdserve.pools" -}}
{{- if eq .Values.mode "colocated" -}}worker{{- else -}}prefill decode{{- end -}}
{{- end -}}

{{/* The worker Deployments: the pools, and the flex pool (workers that may switch role) when it is on */}}
{{- define "pdserve.workerPools" -}}
{{ include "pdserve.pools" . }}
{{- if .Values.flex.enabled -}}
{{- if eq .Values.mode "colocated" -}}
{{- fail "flex.enabled moves workers between prefill and decode: use mode auto or disagg" -}}
{{- end }} flex
{{- end -}}
{{- end -}}

{{/* The selector of the flex pods, as the planner lists them */}}
{{- define "pdserve.flexSelector" -}}
app.kubernetes.io/name={{ include "pdserve.name" . }},app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/component=flex
{{- end -}}

{{- define "pdserve.poolRole" -}}
{{- if eq . "worker" -}}both{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{/* Model: the path passed as --model, and the name every component registers under */}}
{{- define "pdserve.modelPath" -}}
{{- if eq .Values.model.source "builtin" -}}
builtin
{{- else if .Values.model.subPath -}}
{{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.subPath) }}
{{- else if eq .Values.model.source "hf" -}}
{{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (required "model.hf.repo is required with model.source=hf" .Values.model.hf.repo) }}
{{- else -}}
{{ .Values.model.mountPath }}
{{- end -}}
{{- end -}}

{{- define "pdserve.servedModelName" -}}
{{- if .Values.model.servedModelName -}}
{{ .Values.model.servedModelName }}
{{- else if eq .Values.model.source "hf" -}}
{{ .Values.model.hf.repo }}
{{- else -}}
{{ include "pdserve.modelPath" . | trimSuffix "/" | base }}
{{- end -}}
{{- end -}}

{{/* Model volume, mount and init container (nothing for builtin) */}}
{{- define "pdserve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: {{ $m.pvc.readOnly }}
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if has $m.source (list "download" "hf") }}
{{- $vol := ternary $m.hf.volume $m.download.volume (eq $m.source "hf") }}
{{- if eq $vol.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required (printf "model.%s.volume.claimName is required with volume.type=pvc" $m.source) $vol.claimName }}
{{- else }}
- name: model
  emptyDir:
    sizeLimit: {{ $vol.sizeLimit }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMount" -}}
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ not (has .Values.model.source (list "download" "hf")) }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelInit" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "hf" }}
- name: fetch-model
  image: {{ default (include "pdserve.image" .) $m.hf.image }}
  imagePullPolicy: IfNotPresent
  # huggingface_hub comes with the image (a dependency of tokenizers / transformers). snapshot_download into a
  # local_dir fetches only files not already there, so a reused cache volume costs one listing.
  command:
    - python
    - -c
    - |
      import json, os
      from huggingface_hub import snapshot_download
      snapshot_download(repo_id=os.environ["HF_REPO"], revision=os.environ.get("HF_REVISION") or None,
                        local_dir=os.environ["MODEL_DIR"], token=os.environ.get("HF_TOKEN") or None,
                        allow_patterns=json.loads(os.environ["HF_ALLOW_PATTERNS"]) or None)
      print("model ready in", os.environ["MODEL_DIR"])
  env:
    {{- include "pdserve.scratchEnv" . | nindent 4 }}
    - name: HF_REPO
      value: {{ $m.hf.repo | quote }}
    - name: HF_REVISION
      value: {{ $m.hf.revision | quote }}
    - name: HF_ALLOW_PATTERNS
      value: {{ $m.hf.allowPatterns | default list | toJson | quote }}
    - name: MODEL_DIR
      value: {{ include "pdserve.modelPath" . | quote }}
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- with $m.hf.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $m.hf.tokenSecretKey }}
    {{- end }}
    {{- with $m.hf.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.hf.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "pdserve.securityContext" (dict "ctx" $) | nindent 2 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    {{- include "pdserve.scratchMounts" . | nindent 4 }}
{{- end }}
{{- if eq $m.source "download" }}
- name: fetch-model
  image: {{ $m.download.image }}
  imagePullPolicy: IfNotPresent
  command:
    {{- toYaml $m.download.command | nindent 4 }}
  env:
    {{- include "pdserve.scratchEnv" . | nindent 4 }}
    - name: MODEL_URL
      value: {{ required "model.download.url is required with model.source=download" $m.download.url | quote }}
    - name: MODEL_DIR
      value: {{ include "pdserve.modelPath" . | quote }}
    {{- with $m.download.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.download.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $m.download.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- include "pdserve.securityContext" (dict "ctx" $) | nindent 2 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    {{- include "pdserve.scratchMounts" . | nindent 4 }}
{{- end }}
{{- end -}}

{{/* Redis URL env (the URL carries credentials, so an external one always comes from a Secret) */}}
{{- define "pdserve.redisSecretName" -}}
{{- if .Values.redis.external.existingSecret -}}
{{ .Values.redis.external.existingSecret }}
{{- else -}}
{{ include "pdserve.fullname" . }}-redis-url
{{- end -}}
{{- end -}}

{{- define "pdserve.redisEnv" -}}
- name: PDSERVE_REDIS_URL
{{- if .Values.redis.enabled }}
  value: {{ printf "redis://%s-redis:%d/0" (include "pdserve.fullname" .) (int .Values.redis.port) | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}redis-url{{ end }}
{{- end }}
{{- end -}}

{{/* The gateway's tenants file (pdserve/services/gateway/tenants.py reads it): `apiKeys.tenants`, with the plain
     `apiKeys.keys` added to tenant `apiKeys.defaultTenant`; JSON when the Secret key ends in .json, else YAML */}}
{{- define "pdserve.tenantsFile" -}}
{{- $a := .Values.gateway.apiKeys -}}
{{- $tenants := deepCopy ($a.tenants | default dict) -}}
{{- if $a.keys -}}
{{- $t := deepCopy (get $tenants $a.defaultTenant | default dict) -}}
{{- $_ := set $t "keys" (concat ($t.keys | default list) $a.keys) -}}
{{- $_ := set $tenants $a.defaultTenant $t -}}
{{- end -}}
{{- if not $tenants -}}
{{- fail "gateway.apiKeys.enabled needs gateway.apiKeys.keys or gateway.apiKeys.tenants (or an existingSecret)" -}}
{{- end -}}
{{- if hasSuffix ".json" $a.secretKey -}}
{{ dict "tenants" $tenants | toPrettyJson }}
{{- else -}}
{{ dict "tenants" $tenants | toYaml }}
{{- end -}}
{{- end -}}

{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_LOG_LEVEL
  value: {{ .Values.logging.level | quote }}
- name: PDSERVE_LOG_FORMAT
  value: {{ .Values.logging.format | quote }}
{{- with .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: PDSERVE_SERVED_MODEL_NAME
  value: {{ include "pdserve.servedModelName" . | quote }}
{{- with .Values.metrics.compat }}
- name: PDSERVE_METRICS_COMPAT
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Guided-output limits (engine/grammar_limits.py), the same for the gateway and every worker: (dict "ctx" $ "worker" bool) */}}
{{- define "pdserve.guidedEnv" -}}
{{- $g := .ctx.Values.guidedOutput -}}
- name: PDSERVE_MAX_SCHEMA_BYTES
  value: {{ $g.maxSchemaBytes | int64 | quote }}
- name: PDSERVE_MAX_SCHEMA_DEPTH
  value: {{ $g.maxSchemaDepth | int64 | quote }}
- name: PDSERVE_MAX_ENUM_VALUES
  value: {{ $g.maxEnumValues | int64 | quote }}
- name: PDSERVE_MAX_PATTERN_CHARS
  value: {{ $g.maxPatternChars | int64 | quote }}
- name: PDSERVE_MAX_GRAMMAR_BYTES
  value: {{ $g.maxGrammarBytes | int64 | quote }}
- name: PDSERVE_MAX_GRAMMAR_RULES
  value: {{ $g.maxGrammarRules | int64 | quote }}
- name: PDSERVE_GRAMMAR_COMPILE_TIMEOUT
  value: {{ $g.grammarCompileTimeout | quote }}
{{- if .worker }}
- name: PDSERVE_GRAMMAR_PROCESSES
  value: {{ $g.grammarProcesses | int64 | quote }}
{{- end }}
{{- end -}}

{{/* Pod-level scheduling keys: (dict "v" $poolValues) */}}
{{- define "pdserve.scheduling" -}}
{{- with .v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.podCommon" -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" . }}
{{- /* Service links would inject e.g. PDSERVE_PORT=tcp://... for a Service named "pdserve", which every
       pdserve flag reads as its default (PDSERVE_<FLAG>): never inject them. */}}
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Worker grace period: drain timeout + time to stop gRPC, the engine and NIXL */}}
{{- define "pdserve.workerGrace" -}}
{{- if .terminationGracePeriodSeconds -}}
{{ int .terminationGracePeriodSeconds }}
{{- else -}}
{{ add (int .drainTimeout) 15 }}
{{- end -}}
{{- end -}}

{{/* gRPC service names the health checks ask for (SERVING only once the component is ready) */}}
{{- define "pdserve.workerHealthService" -}}pdserve.v1.Worker{{- end -}}
{{- define "pdserve.routerHealthService" -}}pdserve.v1.Router{{- end -}}
{{- define "pdserve.gatewayHealthService" -}}pdserve.v1.Gateway{{- end -}}

{{/* Container securityContext: the global `securityContext` with a component's own keys over it:
     (dict "ctx" $ "over" $componentSecurityContext) */}}
{{- define "pdserve.securityContext" -}}
{{- $sc := mergeOverwrite (deepCopy (.ctx.Values.securityContext | default dict)) (deepCopy (.over | default dict)) -}}
{{- with $sc }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The root filesystem is read-only: HOME, /tmp, compiled kernels and the Hugging Face cache live in the
     `scratch` emptyDir (one volume, two subPaths) */}}
{{- define "pdserve.scratchVolume" -}}
- name: scratch
  emptyDir:
    {{- with .Values.scratch.medium }}
    medium: {{ . }}
    {{- end }}
    sizeLimit: {{ .Values.scratch.sizeLimit }}
{{- end -}}

{{- define "pdserve.scratchMounts" -}}
- name: scratch
  mountPath: /tmp
  subPath: tmp
- name: scratch
  mountPath: {{ .Values.scratch.mountPath }}
  subPath: home
{{- end -}}

{{- define "pdserve.scratchEnv" -}}
{{- $h := trimSuffix "/" .Values.scratch.mountPath -}}
- name: HOME
  value: {{ $h | quote }}
- name: TORCH_EXTENSIONS_DIR
  value: {{ printf "%s/.cache/torch_extensions" $h | quote }}
- name: HF_HOME
  value: {{ printf "%s/.cache/huggingface" $h | quote }}
{{- end -}}

{{/* Labels added to a pod template: `podLabels` of each map in .vs, later maps winning; the selector labels
     are the chart's own (a Deployment's selector is immutable) */}}
{{- define "pdserve.podLabels" -}}
{{- $l := dict -}}
{{- range .vs }}
{{- $l = mergeOverwrite $l (deepCopy (.podLabels | default dict)) -}}
{{- end }}
{{- range $k, $_ := $l }}
{{- if has $k (list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "pdserve.io/role") }}
{{- fail (printf "podLabels may not set %s (a selector label the chart owns)" $k) }}
{{- end }}
{{- end }}
{{- with $l }}{{ toYaml . }}{{ end }}
{{- end -}}

{{/* `extraVolumes` / `extraVolumeMounts` of each map in .vs, concatenated */}}
{{- define "pdserve.extraVolumes" -}}
{{- $all := list -}}
{{- range .vs }}{{ $all = concat $all (.extraVolumes | default list) }}{{ end -}}
{{- with $all }}{{ toYaml . }}{{ end }}
{{- end -}}

{{- define "pdserve.extraVolumeMounts" -}}
{{- $all := list -}}
{{- range .vs }}{{ $all = concat $all (.extraVolumeMounts | default list) }}{{ end -}}
{{- with $all }}{{ toYaml . }}{{ end }}
{{- end -}}

{{/* Internal security (docs/services.md, "Trust model"): Secret names, the files each pdserve pod mounts, and the
     env that names them (paths only: the secrets stay in their files) */}}
{{- define "pdserve.internalTokenSecret" -}}
{{- default (printf "%s-internal-token" (include "pdserve.fullname" .)) .Values.security.internalToken.existingSecret -}}
{{- end -}}

{{- define "pdserve.redisAuthSecret" -}}
{{- default (printf "%s-redis-auth" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* Redis AUTH: as set, or unset (null) on exactly when the chart runs its own Redis (closed by default) */}}
{{- define "pdserve.redisAuthOn" -}}
{{- $on := .Values.redis.auth.enabled -}}
{{- if kindIs "invalid" $on }}{{ $on = .Values.redis.enabled }}{{ end -}}
{{- if $on }}true{{ end -}}
{{- end -}}

{{- define "pdserve.tlsEnabled" -}}
{{- if .Values.security.tls.enabled -}}
{{- $_ := required "security.tls.secretName is required with security.tls.enabled (a Secret with the PEM cert, key and CA)" .Values.security.tls.secretName -}}
true
{{- end -}}
{{- end -}}

{{- define "pdserve.securityEnv" -}}
{{- $s := .Values.security -}}
{{- if $s.internalToken.enabled }}
- name: PDSERVE_INTERNAL_TOKEN_FILE
  value: {{ printf "/etc/pdserve/internal-token/%s" $s.internalToken.secretKey | quote }}
{{- end }}
{{- if include "pdserve.tlsEnabled" . }}
- name: PDSERVE_TLS_CERT
  value: {{ printf "/etc/pdserve/tls/%s" $s.tls.certKey | quote }}
- name: PDSERVE_TLS_KEY
  value: {{ printf "/etc/pdserve/tls/%s" $s.tls.keyKey | quote }}
{{- if $s.tls.caKey }}
- name: PDSERVE_TLS_CA
  value: {{ printf "/etc/pdserve/tls/%s" $s.tls.caKey | quote }}
{{- end }}
{{- if $s.tls.serverName }}
- name: PDSERVE_TLS_SERVER_NAME
  value: {{ $s.tls.serverName | quote }}
{{- end }}
{{- end }}
{{- if not (or $s.internalToken.enabled (and (include "pdserve.tlsEnabled" .) $s.tls.caKey)) }}
# the values turned internal authentication off: said, at WARNING, by every pod (docs/services.md, Trust model)
- name: PDSERVE_INSECURE_INTERNAL
  value: "1"
{{- end }}
{{- if include "pdserve.redisAuthOn" . }}
- name: PDSERVE_REDIS_PASSWORD_FILE
  value: {{ printf "/etc/pdserve/redis-auth/%s" .Values.redis.auth.passwordKey | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.securityMounts" -}}
{{- if .Values.security.internalToken.enabled }}
- name: internal-token
  mountPath: /etc/pdserve/internal-token
  readOnly: true
{{- end }}
{{- if include "pdserve.tlsEnabled" . }}
- name: internal-tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- if include "pdserve.redisAuthOn" . }}
- name: redis-auth
  mountPath: /etc/pdserve/redis-auth
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.securityVolumes" -}}
{{- if .Values.security.internalToken.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "pdserve.internalTokenSecret" . }}
    defaultMode: 0440
{{- end }}
{{- if include "pdserve.tlsEnabled" . }}
- name: internal-tls
  secret:
    secretName: {{ .Values.security.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if include "pdserve.redisAuthOn" . }}
- name: redis-auth
  secret:
    secretName: {{ include "pdserve.redisAuthSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* A gRPC health probe of a router/worker port: the kubelet's own (plaintext), or with internal TLS the
     exec probe that speaks it: (dict "ctx" $ "port" 7100 "service" "pdserve.v1.Worker") */}}
{{- define "pdserve.grpcProbe" -}}
{{- if include "pdserve.tlsEnabled" .ctx }}
exec:
  command: ["python", "-m", "pdserve.services.health_probe", "--port", {{ .port | quote }}, "--service", {{ .service | quote }}]
timeoutSeconds: 3
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service }}
{{- end }}
{{- end -}}
