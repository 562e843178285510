-- Q11, user sessions: the bids of each bidder per session (its bids less than 10 s apart in
-- event time), with the session's bounds: its first bid, and 10 s after its last one.
-- Sessionized with window functions: a bid 10 s or more after the bidder's previous one
-- starts a session; a running sum of those starts numbers them.
WITH marked AS (
    SELECT bidder, event_time,
           CASE WHEN event_time - lag(event_time) OVER (PARTITION BY bidder ORDER BY event_time)
                     < 10000000 THEN 0 ELSE 1 END AS starts
    FROM bid
), numbered AS (
    SELECT bidder, event_time,
           sum(starts) OVER (PARTITION BY bidder ORDER BY event_time
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS session
    FROM marked
)
SELECT bidder, min(event_time) AS session_start, max(event_time) + 10000000 AS session_end,
       count(*) AS bids
FROM numbered
GROUP BY bidder, session
