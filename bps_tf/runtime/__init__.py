"""The floor of bps_tf, without TensorFlow: the native core and its loader,
joining and leaving the cluster, process sets, the cluster spec, settings,
the job token's keys, the op library's build, and the servers' health
service. Servers import only this layer."""
