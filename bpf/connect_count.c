// Counts connect() calls on this host, per CPU, from the syscalls:sys_enter_connect tracepoint.
// Only the tracepoint's own arguments are used; no kernel struct is read.

BPF_PERCPU_ARRAY(connect_calls, u64, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_connect) {
    u32 zero = 0;
    u64 *count = connect_calls.lookup(&zero);
    if (count) {
        *count += 1;
    }
    return 0;
}
