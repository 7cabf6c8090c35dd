"""Communication over the push_pull ops: the collectives every face calls
(the only users of the op wrappers), the cross-worker key contract,
gradient compression, the asynchronous exchange and the ops' gradients."""
