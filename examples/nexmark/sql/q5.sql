-- Q5, hot items: the auction(s) with the most bids in each sliding window of 10 s, every 2 s.
WITH windowed AS (
    SELECT auction, (event_time // 2000000 - i) * 2000000 AS window_start
    FROM bid, range(5) AS slides(i)
),
counts AS (
    SELECT auction, window_start, count(*) AS num FROM windowed GROUP BY auction, window_start
),
top AS (SELECT window_start, max(num) AS num FROM counts GROUP BY window_start)
SELECT counts.window_start, counts.auction, counts.num
FROM counts JOIN top USING (window_start, num)
