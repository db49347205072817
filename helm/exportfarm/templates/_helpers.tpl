{{/* Names, labels and the pieces every pod of the farm shares. */}}

{{- define "exportfarm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "exportfarm.fullname" -}}
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

{{/* "<fullname>-<suffix>", kept within the 63 characters a name may have. */}}
{{- define "exportfarm.componentName" -}}
{{- $full := include "exportfarm.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .component)))) .component | trimSuffix "-" }}
{{- end }}

{{- define "exportfarm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "exportfarm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: exportfarm
{{- end }}

{{/* Selector labels of one component: {root, component}. */}}
{{- define "exportfarm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "exportfarm.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "exportfarm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "exportfarm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret the pods read credentials from: the user's, or the one this chart makes. */}}
{{- define "exportfarm.secretName" -}}
{{- default (include "exportfarm.fullname" .) .Values.credentials.existingSecret }}
{{- end }}

{{/* image: {root, image}; the tag falls back to image.tag, then to the chart's appVersion. */}}
{{- define "exportfarm.image" -}}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- printf "%s:%s" .image.repository (toString $tag) }}
{{- end }}

{{/* The Secret's data, shared by the release Secret and the migration hook's copy of it. */}}
{{- define "exportfarm.secretData" -}}
{{- $c := .Values.credentials }}
{{- $data := dict }}
{{- range $key, $value := dict "DATABASE_URL" $c.databaseUrl "REDIS_URL" $c.redisUrl "S3_ACCESS_KEY" $c.s3AccessKey "S3_SECRET_KEY" $c.s3SecretKey "ADMIN_TOKEN" $c.adminToken "SIGNING_SECRET" $c.signingSecret }}
{{- if $value }}{{ $_ := set $data $key $value }}{{ end }}
{{- end }}
{{- $a := .Values.gpuWorker.autoscaling }}
{{- if and .Values.gpuWorker.enabled $a.enabled $c.databaseUrl (not $a.catalog.connectionSecret.name) }}
{{- /* KEDA's PostgreSQL scaler reads the catalog with a libpq URL: the farm's, without SQLAlchemy's driver. */}}
{{- $_ := set $data "CATALOG_CONNECTION" (regexReplaceAll "^postgresql\\+[a-z0-9]+://" $c.databaseUrl "postgresql://") }}
{{- end }}
{{- range $key, $value := $c.extraSecret }}
{{- $_ := set $data $key $value }}
{{- end }}
{{- range $key, $value := $data }}
{{ $key }}: {{ $value | toString | b64enc | quote }}
{{- end }}
{{- end }}

{{/* Annotations that restart pods when their settings change. */}}
{{- define "exportfarm.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if not .Values.credentials.existingSecret }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- end }}

{{/* Settings as environment: non-secret ones from the ConfigMap, credentials from the Secret. */}}
{{- define "exportfarm.envFrom" -}}
- configMapRef:
    name: {{ include "exportfarm.fullname" . }}
- secretRef:
    name: {{ include "exportfarm.secretName" . }}
{{- end }}

{{/*
The workers' service account (worker-rbac.yaml): their own where the chart makes service accounts,
else the one serviceAccount.name names.
*/}}
{{- define "exportfarm.workerServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- include "exportfarm.componentName" (dict "root" . "component" "worker") }}
{{- else }}
{{- include "exportfarm.serviceAccountName" . }}
{{- end }}
{{- end }}

{{/* Pod-level fields every farm pod shares: no Kubernetes API token, and podSpecShared. */}}
{{- define "exportfarm.podSpecCommon" -}}
serviceAccountName: {{ include "exportfarm.serviceAccountName" . }}
automountServiceAccountToken: false
{{ include "exportfarm.podSpecShared" . }}
{{- end }}

{{/* Pod-level fields every farm pod shares, whatever its service account. */}}
{{- define "exportfarm.podSpecShared" -}}
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Writable paths under a read-only root: /tmp and the data directory (also $HOME). */}}
{{- define "exportfarm.baseVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: data
  mountPath: /var/lib/exportfarm
{{- if .Values.models.existingClaim }}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "exportfarm.baseVolumes" -}}
- name: tmp
  emptyDir: {}
- name: data
  emptyDir: {}
{{- if .Values.models.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{/*
Worker probe (services/health.py, as the image's HEALTHCHECK): ask this pod's Celery node for a
pong over the broker. The worker names itself celery@<hostname> (exportfarm worker without --name),
and its main process answers control messages even while its pool child runs an export, so a hung
or disconnected consumer fails this while a busy one passes. It imports only celery, not the export
code (cheap next to a running job).
*/}}
{{- define "exportfarm.workerPing" -}}
exec:
  command: ["python", "-m", "services.health", "worker", "--timeout", "10"]
{{- end }}

{{/* Beat probe: the broker that beat sends scheduled jobs to answers from this pod. */}}
{{- define "exportfarm.brokerCheck" -}}
exec:
  command: ["python", "-m", "services.health", "beat", "--timeout", "5"]
{{- end }}

{{/*
The worker classes: gpuWorker and cpuWorker (named by the first queue they consume: "gpu", "cpu")
and each of extraWorkerClasses, the latter as its execution provider's base class with the entry's
values over it. YAML list of {name, component, ep, w}; a worker class is one Deployment consuming
the queue of its name.
*/}}
{{- define "exportfarm.workerClasses" -}}
{{- $classes := list }}
{{- if .Values.gpuWorker.enabled }}
{{- $classes = append $classes (dict "name" (splitList "," .Values.gpuWorker.queues | first | trim) "component" "gpu" "ep" "cuda" "w" .Values.gpuWorker) }}
{{- end }}
{{- if .Values.cpuWorker.enabled }}
{{- $classes = append $classes (dict "name" (splitList "," .Values.cpuWorker.queues | first | trim) "component" "cpu" "ep" "cpu" "w" .Values.cpuWorker) }}
{{- end }}
{{- range .Values.extraWorkerClasses }}
{{- $base := ternary $.Values.gpuWorker $.Values.cpuWorker (eq .ep "cuda") }}
{{- $w := mergeOverwrite (deepCopy $base) (omit . "name" "ep") }}
{{- $_ := set $w "queues" .name }}
{{- $_ := set $w "enabled" true }}
{{- $auto := deepCopy $w.autoscaling | default dict }}
{{- $_ := set $auto "enabled" false }}
{{- $_ := set $w "autoscaling" $auto }}
{{- $classes = append $classes (dict "name" .name "component" .name "ep" .ep "w" $w) }}
{{- end }}
{{- toYaml $classes }}
{{- end }}

{{/* A worker class's memory limit in GiB (limits.memory must be whole Gi: the placement compares it). */}}
{{- define "exportfarm.memoryGi" -}}
{{- $limit := toString (.w.resources.limits.memory | default "") }}
{{- if not (regexMatch "^[0-9]+Gi$" $limit) }}
{{- fail (printf "worker class %s: resources.limits.memory must be whole GiB like 64Gi (got %q): the farm places jobs by it" .name $limit) }}
{{- end }}
{{- trimSuffix "Gi" $limit }}
{{- end }}

{{/* QUEUE_CLASSES: each worker class's execution provider and what one of its workers has (GiB). */}}
{{- define "exportfarm.queueClasses" -}}
{{- $out := dict }}
{{- range (include "exportfarm.workerClasses" . | fromYamlArray) }}
{{- $spec := dict "ep" .ep "memory_gb" (include "exportfarm.memoryGi" . | int) }}
{{- if eq .ep "cuda" }}
{{- $_ := set $spec "gpu_memory_gb" (required (printf "worker class %s: gpuMemoryGi (the GPU's memory) is needed" .name) .w.gpuMemoryGi) }}
{{- end }}
{{- $size := toString .w.workVolume.size }}
{{- if regexMatch "^[0-9]+Gi$" $size }}
{{- $_ := set $spec "disk_gb" (trimSuffix "Gi" $size | int) }}
{{- else if regexMatch "^[0-9]+Ti$" $size }}
{{- $_ := set $spec "disk_gb" (mul (trimSuffix "Ti" $size | int) 1024) }}
{{- end }}
{{- $_ := set $out .name $spec }}
{{- end }}
{{- toJson $out }}
{{- end }}
