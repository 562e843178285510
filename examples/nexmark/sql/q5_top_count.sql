-- Q5's highest count: the most bids any auction had in each sliding window of 10 s, every 2 s.
WITH windowed AS (
    SELECT auction, (event_time // 2000000 - i) * 2000000 AS window_start
    FROM bid, range(5) AS slides(i)
),
counts AS (
    SELECT auction, window_start, count(*) AS num FROM windowed GROUP BY auction, window_start
)
SELECT window_start, max(num)::DOUBLE AS num FROM counts GROUP BY window_start
