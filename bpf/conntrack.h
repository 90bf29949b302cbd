// The constants bpf/conntrack.c and its loader (agent/_conntrack.py) share: the one place they are written.
// Python reads every `#define NAME <integer>` here (prismlb.bpf.constants); conntrack.c includes this file.

#define EVENT_ESTABLISHED 1
#define EVENT_CLOSED 2

#define ROLE_CLIENT 0
#define ROLE_SERVER 1

#define FILTER_PORTS 0
#define FILTER_PIDS 1

// Indices in `tcp_counts`, read by agent/_conntrack.py by these names.
#define COUNT_OPENED 0       // connections that became traced
#define COUNT_ENDED 1        // traced connections whose CLOSED event was sent (socket freed, or reused)
#define COUNT_RETRANSMITS 2  // segments retransmitted on traced connections (a client's SYNs once established)
#define COUNT_RESETS 3       // RSTs sent or received (see on_reset)
#define COUNT_REFUSED 4      // connects that ended without being established
#define COUNTS 5

#define CONNS_ENTRIES 65536   // live connections tracked at once (an LRU: the oldest go first)
#define FILTER_ENTRIES 1024   // ports, and processes, the loader may filter on
