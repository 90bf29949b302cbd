// Every TCP connection on this host, client and server side, IPv4 and IPv6, from tracepoints only: one
// ESTABLISHED event (handshake time on the client side) and one CLOSED event (bytes, retransmits) each,
// plus per-CPU counts of connect() calls and of the TCP signals of node health (`tcp_counts`). Every field
// comes from a tracepoint's own arguments or a BPF helper; no kernel struct is read, so the program does not
// depend on the kernel's struct layouts.
//
// The live state of a connection is kept in `conns`, keyed by the socket's address (skaddr), created when
// the connection starts (client: CLOSE->SYN_SENT inside connect(); server: SYN_RECV->ESTABLISHED) and
// deleted on ->CLOSE if it never was established, else on tcp_destroy_sock, when the socket is freed: a
// socket can reach CLOSE with data still to read (a FIN or RST behind it), and those bytes count too.
// The pid is only read in process context: inside connect() on the client side, on the first
// sendmsg/recvmsg on the server side (where the ESTABLISHED event waits for it); never in softirq.
//
// A connection is *traced* once it is known to pass both filters: a client at ESTABLISHED (pid checked at
// SYN_SENT, ports there); a server at ESTABLISHED without a pid filter, else at its first send/recv by a wanted
// process. Only traced connections have events and count in `tcp_counts`, which are counters rather than
// events so that a full ring buffer loses none of them and a connection that stays open shows its
// retransmits in the window they happen in: opened and ended (the agent's connections active in a window are
// those opened by its end less those ended before its start), retransmits, resets sent or received, and
// connects that never completed (refused, timed out, unreachable or abandoned: SYN_SENT -> CLOSE).
// A CLOSED event follows only an ESTABLISHED one: a server-side connection that no process ever read or wrote
// (a port scan, a health check's connect, a listener that closes at once) carried nothing a span could be
// joined to, so it is only counted.
//
// Events go through one ring buffer for all CPUs (`events`, PRISM_EVENT_PAGES pages, set by the loader), in the
// order they were written; one that does not fit is counted in `lost_events` instead.

#define PRISM_AF_INET 2
#define PRISM_AF_INET6 10
#define PRISM_IPPROTO_TCP 6
#define PRISM_MSG_PEEK 2

#define PRISM_TCP_ESTABLISHED 1
#define PRISM_TCP_SYN_SENT 2
#define PRISM_TCP_SYN_RECV 3
#define PRISM_TCP_CLOSE 7

#include "conntrack.h"

// A connection as it stands (the value in `conns`) and, with kind set, the event sent to user space: the one
// definition of the event, whose layout Python takes from bcc's description of this struct (`conns`' leaf).
struct conn {
    u64 sock_id;          // the socket's kernel address: the key in `conns`, unique while the socket lives
    u64 syn_ns;           // client: CLOSE->SYN_SENT, when connect() sends the SYN; 0 on the server side
    u64 established_ns;   // ->ESTABLISHED; 0 before (bpf_ktime_get_ns: CLOCK_MONOTONIC, like every *_ns here)
    u64 closed_ns;        // ->CLOSE; 0 before
    u64 bytes_sent;       // sendmsg() results > 0
    u64 bytes_received;   // recvmsg() results > 0, MSG_PEEK excluded
    u64 announced;        // 1 once the ESTABLISHED event is out (64 bits: atomically exchanged)
    u32 retransmits;      // segments retransmitted (SYNs included)
    u32 pid;              // 0 until known
    u32 tid;
    u16 family;           // 2 (AF_INET) or 10 (AF_INET6)
    u16 lport;            // local port: 0 at SYN_SENT, set at ESTABLISHED
    u16 rport;
    u8 kind;              // event: EVENT_ESTABLISHED or EVENT_CLOSED; 0 in the map
    u8 role;              // ROLE_CLIENT or ROLE_SERVER
    u8 traced;            // 1 once the connection passes both filters (counted in tcp_counts from then on)
    u8 laddr[16];         // IPv4 in the first 4 bytes
    u8 raddr[16];
    char comm[16];
};

BPF_PERCPU_ARRAY(connect_calls, u64, 1);
BPF_PERCPU_ARRAY(lost_events, u64, 1);  // events the ring buffer had no room for
BPF_PERCPU_ARRAY(tcp_counts, u64, COUNTS);
BPF_TABLE("lru_hash", u64, struct conn, conns, CONNS_ENTRIES);
BPF_HASH(ports, u16, u8, FILTER_ENTRIES);   // local or remote ports to trace
BPF_HASH(pids, u32, u8, FILTER_ENTRIES);    // processes to trace
// [FILTER_PORTS], [FILTER_PIDS]: 1 while every port / every process is traced. The loader sets them; until
// then they are 0 and the sets empty, so nothing slips past a filter between attaching and configuring.
BPF_ARRAY(match_all, u32, 2);
BPF_RINGBUF_OUTPUT(events, PRISM_EVENT_PAGES);

static __always_inline int filter_on(u32 which) {
    u32 *all = match_all.lookup(&which);
    return !all || !*all;
}

static __always_inline int pid_wanted(u32 pid) {
    return !filter_on(FILTER_PIDS) || pids.lookup(&pid);
}

static __always_inline int ports_wanted(u16 lport, u16 rport) {
    return !filter_on(FILTER_PORTS) || ports.lookup(&lport) || ports.lookup(&rport);
}

static __always_inline void take_process(struct conn *c) {
    u64 id = bpf_get_current_pid_tgid();
    c->pid = id >> 32;
    c->tid = (u32)id;
    bpf_get_current_comm(&c->comm, sizeof(c->comm));
}

static __always_inline void count(u32 which, u64 n) {
    u64 *slot = tcp_counts.lookup(&which);
    if (slot) {
        __sync_fetch_and_add(slot, n);
    }
}

// The connection passes both filters from now on: count it open, with the retransmits it already had (a
// client's SYNs).
static __always_inline void start_tracing(struct conn *c) {
    c->traced = 1;
    count(COUNT_OPENED, 1);
    count(COUNT_RETRANSMITS, c->retransmits);
}

// The kernel wakes the reader only when it has taken every earlier event (adaptive notification), so a busy
// reader is not woken once per event.
static __always_inline void emit(struct conn *c, u8 kind) {
    struct conn *event = events.ringbuf_reserve(sizeof(struct conn));
    if (!event) {
        u32 zero = 0;
        u64 *lost = lost_events.lookup(&zero);
        if (lost) {
            __sync_fetch_and_add(lost, 1);
        }
        return;
    }
    *event = *c;
    event->kind = kind;
    events.ringbuf_submit(event, 0);
}

// The end of a traced connection, and its CLOSED event when its ESTABLISHED one went out. A server-side
// connection that no process ever read or wrote has no pid, so under a pid filter it never was traced.
static __always_inline void finish(struct conn *c) {
    if (c->traced) {
        count(COUNT_ENDED, 1);
        if (c->announced) {
            emit(c, EVENT_CLOSED);
        }
    }
}

// A RST sent or received on socket `sk` (0: none), `lport` and `rport` as this host sees them. A connection in
// `conns` counts once traced (a refused connect's RST is counted as refused, at CLOSE); any other socket (none:
// a segment to a port nobody listens on; or a connection older than the program) only without a pid filter,
// as no process can be checked in softirq, and when its ports pass the port filter.
static __always_inline void on_reset(u64 sk, u16 lport, u16 rport) {
    struct conn *c = sk ? conns.lookup(&sk) : 0;
    if (c) {
        if (c->traced) {
            count(COUNT_RESETS, 1);
        }
    } else if (!filter_on(FILTER_PIDS) && ports_wanted(lport, rport)) {
        count(COUNT_RESETS, 1);
    }
}

// sendmsg/recvmsg run in the calling process's context: count the bytes and, on the server side, take the
// pid the first time and send the ESTABLISHED event that waited for it.
static __always_inline void on_io(u64 sk, int bytes, int received) {
    struct conn *c = conns.lookup(&sk);
    if (!c) {
        return;
    }
    if (bytes > 0) {
        if (received) {
            __sync_fetch_and_add(&c->bytes_received, bytes);
        } else {
            __sync_fetch_and_add(&c->bytes_sent, bytes);
        }
    }
    if (c->role != ROLE_SERVER || __sync_lock_test_and_set(&c->announced, 1)) {
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    if (!pid_wanted(id >> 32)) {
        conns.delete(&sk);
        return;
    }
    take_process(c);
    if (!c->traced) {
        start_tracing(c);
    }
    emit(c, EVENT_ESTABLISHED);
}

TRACEPOINT_PROBE(syscalls, sys_enter_connect) {
    u32 zero = 0;
    u64 *count = connect_calls.lookup(&zero);
    if (count) {
        *count += 1;
    }
    return 0;
}

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    if (args->protocol != PRISM_IPPROTO_TCP) {
        return 0;
    }
    if (args->family != PRISM_AF_INET && args->family != PRISM_AF_INET6) {
        return 0;
    }
    u64 sk = (u64)args->skaddr;
    int newstate = args->newstate;

    if (newstate == PRISM_TCP_SYN_SENT) {  // inside connect(): process context
        struct conn *reused = conns.lookup(&sk);
        if (reused) {  // connect() again on a socket whose connection closed: that one is over
            finish(reused);
        }
        u64 id = bpf_get_current_pid_tgid();
        if (!pid_wanted(id >> 32)) {
            conns.delete(&sk);
            return 0;
        }
        struct conn c = {};
        c.sock_id = sk;
        c.role = ROLE_CLIENT;
        c.syn_ns = bpf_ktime_get_ns();
        take_process(&c);
        conns.update(&sk, &c);
        return 0;
    }

    if (newstate == PRISM_TCP_CLOSE) {
        struct conn *c = conns.lookup(&sk);
        if (!c) {
            return 0;
        }
        if (c->established_ns) {
            c->closed_ns = bpf_ktime_get_ns();  // the CLOSED event waits for tcp_destroy_sock
            return 0;
        }
        // Never established (only a client is in `conns` before ESTABLISHED): refused, timed out, unreachable
        // or closed while connecting. No event; counted when its ports, known by now, pass the port filter.
        if (ports_wanted(args->sport, args->dport)) {
            count(COUNT_REFUSED, 1);
        }
        conns.delete(&sk);
        return 0;
    }

    if (newstate != PRISM_TCP_ESTABLISHED) {
        return 0;
    }
    u16 lport = args->sport;
    u16 rport = args->dport;
    struct conn *c;
    struct conn fresh = {};
    if (args->oldstate == PRISM_TCP_SYN_SENT) {  // client: softirq, the pid was taken at SYN_SENT
        c = conns.lookup(&sk);
        if (!c) {
            return 0;  // connect() began before the program was attached, or its pid is filtered out
        }
        if (!ports_wanted(lport, rport)) {
            conns.delete(&sk);
            return 0;
        }
    } else if (args->oldstate == PRISM_TCP_SYN_RECV) {  // server: the pid comes with the first send/recv
        if (!ports_wanted(lport, rport)) {
            return 0;
        }
        fresh.sock_id = sk;
        fresh.role = ROLE_SERVER;
        c = &fresh;
    } else {
        return 0;
    }
    c->established_ns = bpf_ktime_get_ns();
    c->family = args->family;
    c->lport = lport;
    c->rport = rport;
    if (args->family == PRISM_AF_INET) {
        __builtin_memcpy(c->laddr, args->saddr, 4);
        __builtin_memcpy(c->raddr, args->daddr, 4);
    } else {
        __builtin_memcpy(c->laddr, args->saddr_v6, 16);
        __builtin_memcpy(c->raddr, args->daddr_v6, 16);
    }
    if (c->role == ROLE_SERVER) {
        if (!filter_on(FILTER_PIDS)) {
            start_tracing(c);
        }
        conns.update(&sk, c);
        return 0;
    }
    c->announced = 1;
    start_tracing(c);
    emit(c, EVENT_ESTABLISHED);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length) {
    if (args->protocol == PRISM_IPPROTO_TCP) {
        on_io((u64)args->sk, args->ret, 0);
    }
    return 0;
}

TRACEPOINT_PROBE(sock, sock_recv_length) {
    if (args->protocol == PRISM_IPPROTO_TCP) {
        on_io((u64)args->sk, (args->flags & PRISM_MSG_PEEK) ? 0 : args->ret, 1);
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
#ifdef PRISM_RETRANSMIT_HAS_ERR
    if (args->err) {
        return 0;  // the attempt failed (e.g. the segment was still queued): the kernel tries again
    }
#endif
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c) {
        __sync_fetch_and_add(&c->retransmits, 1);
        if (c->traced) {
            count(COUNT_RETRANSMITS, 1);
        }
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_receive_reset) {
    on_reset((u64)args->skaddr, args->sport, args->dport);
    return 0;
}

// tcp_send_reset's `reason` field (Linux 6.10 on) has a kernel enum type, which bcc copies into the arguments'
// struct but which no header the program includes defines (or may, with newer headers): renamed to an enum of the
// same size (int) defined here, so that either way the struct compiles. The field is never read.
#define sk_rst_reason prism_sk_rst_reason
enum prism_sk_rst_reason { PRISM_RST_REASON_UNREAD };

TRACEPOINT_PROBE(tcp, tcp_send_reset) {
#ifdef PRISM_SEND_RESET_SOCKADDR
    // Linux 6.10 on: the local and remote addresses as sockaddr_in/_in6, whose port (big-endian) is at offset 2
    // in both; the socket may be absent (a reply to a segment no socket holds).
    u16 lport = (args->saddr[2] << 8) | args->saddr[3];
    u16 rport = (args->daddr[2] << 8) | args->daddr[3];
#else
    u16 lport = args->sport;
    u16 rport = args->dport;
#endif
    on_reset((u64)args->skaddr, lport, rport);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_destroy_sock) {
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c) {
        finish(c);
        conns.delete(&sk);
    }
    return 0;
}
