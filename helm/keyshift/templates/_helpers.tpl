{{/*
Names and labels shared by the chart's templates.
*/}}

{{/* The chart name (app.kubernetes.io/name), at most 63 characters. */}}
{{- define "keyshift.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every resource name: the release name, plus the chart name unless the release
name already contains it; at most 63 characters (names also become label values).
*/}}
{{- define "keyshift.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* name-version, as the helm.sh/chart label wants it. */}}
{{- define "keyshift.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of the operator's pods, and its Deployment's and Service's selector. */}}
{{- define "keyshift.selectorLabels" -}}
app.kubernetes.io/name: {{ include "keyshift.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels every resource of the chart carries. */}}
{{- define "keyshift.labels" -}}
helm.sh/chart: {{ include "keyshift.chart" . }}
app.kubernetes.io/name: {{ include "keyshift.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: keyshift
{{- end -}}

{{/* Labels of the operator's resources: the common ones and the component. */}}
{{- define "keyshift.operatorLabels" -}}
{{ include "keyshift.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's metrics Service (a DNS label: at most 63 characters). */}}
{{- define "keyshift.metricsServiceName" -}}
{{- printf "%s-metrics" (include "keyshift.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The operator's ServiceAccount. */}}
{{- define "keyshift.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "keyshift.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The keyshift image: repository@digest when a digest is pinned, else repository:tag (the tag
defaults to the chart's appVersion).
*/}}
{{- define "keyshift.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/*
What the operator puts into the children of every StreamingJob (KEYSHIFT_CHILD_OPTIONS, read by
keyshift.operator.k8s_children.child_options_from_env): the image of jobs without one, and the
NetworkPolicy and PodDisruptionBudget settings when they are enabled. JSON.
*/}}
{{- define "keyshift.childOptions" -}}
{{- $options := dict "jobImage" (include "keyshift.image" .) -}}
{{- if .Values.networkPolicy.enabled -}}
{{- $operator := dict
      "namespaceLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)
      "podLabels" (include "keyshift.selectorLabels" . | fromYaml) -}}
{{- $_ := set $options "networkPolicy" (dict
      "operator" $operator
      "prometheus" .Values.networkPolicy.prometheus
      "sparkClients" .Values.networkPolicy.sparkClients) -}}
{{- end -}}
{{- if .Values.podDisruptionBudget.enabled -}}
{{- $_ := set $options "podDisruptionBudget" (dict "maxUnavailable" .Values.podDisruptionBudget.maxUnavailable) -}}
{{- end -}}
{{- toJson $options -}}
{{- end -}}

{{/*
The RBAC rules on StreamingJobs and their children, in a namespace (Role) or everywhere
(ClusterRole). Each verb is one the operator or kopf uses; see the README's "Installing with
Helm" and the comments below.
*/}}
{{- define "keyshift.namespacedRules" -}}
# kopf lists and watches StreamingJobs, and merge-/JSON-patches them (finalizer, annotations
# with its progress and last-handled spec).
- apiGroups: [keyshift.io]
  resources: [streamingjobs]
  verbs: [list, watch, patch]
# kopf writes the handlers' status (phase, stages, decisions, conditions) through the status
# subresource.
- apiGroups: [keyshift.io]
  resources: [streamingjobs/status]
  verbs: [patch]
# The children carry an owner reference with blockOwnerDeletion, which the API server's
# OwnerReferencesPermissionEnforcement admission allows only with update on the owner's
# finalizers.
- apiGroups: [keyshift.io]
  resources: [streamingjobs/finalizers]
  verbs: [update]
# The job file (ConfigMap) and the coordinator's and stages' Services: created, or patched
# when they exist.
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [create, patch]
# Secrets: each job's token Secret is created once and read back (its value is what the
# operator's calls to the coordinator present); a job's TLS Secret is read for its CA.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# The coordinator and the PySpark apps (Deployments): created, or patched when they exist.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [create, patch]
# The stages (StatefulSets): read for their replicas and ready pods, created or patched,
# and scaled (a patch of spec.replicas).
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, create, patch]
# kopf posts core v1 Events (Reconciled, InvalidSpec, AutoscalerDecision, Scaled, ...).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.networkPolicy.enabled }}
# Each job's NetworkPolicy (networkPolicy.enabled): created, or patched when it exists.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch]
{{- end }}
{{- if .Values.podDisruptionBudget.enabled }}
# Each stage's PodDisruptionBudget (podDisruptionBudget.enabled): created, or patched.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
{{- end }}
{{- end -}}

{{/* What kopf reads cluster-wide whatever the namespaces served. */}}
{{- define "keyshift.crdRules" -}}
# kopf watches CustomResourceDefinitions to notice when the StreamingJob CRD changes.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end -}}
