-- Q8, monitor new users: people who opened an auction in the same tumbling window of 10 s in
-- which they registered, one row per (person, auction) pair, as the window join sends them
-- (NEXMark's answer is the DISTINCT of the first three columns).
SELECT P.id, P.name, P.event_time // 10000000 * 10000000 AS window_start, A.id AS auction
FROM person AS P JOIN auction AS A
    ON P.id = A.seller AND P.event_time // 10000000 = A.event_time // 10000000
